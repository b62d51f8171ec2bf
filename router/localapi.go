package router

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/weft-net/weft/api"
	"github.com/weft-net/weft/ipalloc"
)

// allocateWait bounds how long an allocation waits for space (a claim or a
// donation); the plugin then reports "try again", and the runtime retries.
const allocateWait = 20 * time.Second

// resetWait bounds how long weft reset waits for the heir to confirm the
// handover (the client gives up after 30 s).
const resetWait = 20 * time.Second

// maxRequestBody bounds a local API request; a GC list of 10,000 attachments fits.
const maxRequestBody = 4 << 20

// localAPI serves the plugin over the unix socket. It is the only place that
// changes allocations.
type localAPI struct {
	r *Router
}

// newLocalAPIServer is the local API's server for r, with its limits;
// serve it on limitListener(ln, localAPILimits.MaxConns).
func newLocalAPIServer(r *Router) *http.Server {
	srv := newServer((&localAPI{r: r}).handler(), localAPILimits)
	srv.ConnContext = withAccepted
	return srv
}

func (l *localAPI) handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST "+api.PathIP, l.instrument("allocate", l.allocate))
	mux.HandleFunc("GET "+api.PathIP, l.instrument("lookup", l.lookup))
	mux.HandleFunc("DELETE "+api.PathIP, l.instrument("release", l.release))
	mux.HandleFunc("POST "+api.PathGC, l.instrument("gc", l.gc))
	mux.HandleFunc("GET "+api.PathReady, l.instrument("ready", l.ready))
	mux.HandleFunc("POST "+api.PathRmpeer, l.instrument("rmpeer", l.rmpeer))
	mux.HandleFunc("POST "+api.PathReset, l.instrument("reset", l.reset))
	mux.HandleFunc("/", func(w http.ResponseWriter, req *http.Request) {
		writeError(w, http.StatusNotFound, api.CodeInvalid, fmt.Sprintf("no local API endpoint %s %s", req.Method, req.URL.Path))
	})
	return mux
}

// statusWriter remembers the status code for metrics.
type statusWriter struct {
	http.ResponseWriter
	code int
}

func (s *statusWriter) WriteHeader(code int) { s.code = code; s.ResponseWriter.WriteHeader(code) }

// instrument counts and times op's requests. The series of op's
// successes and its duration are looked up once, not per request.
func (l *localAPI) instrument(op string, h http.HandlerFunc) http.HandlerFunc {
	ok := l.r.metrics.apiRequests.WithLabelValues(op, strconv.Itoa(http.StatusOK))
	duration := l.r.metrics.apiDuration.WithLabelValues(op)
	return func(w http.ResponseWriter, req *http.Request) {
		start := requestStart(req)
		sw := &statusWriter{ResponseWriter: w, code: http.StatusOK}
		h(sw, req)
		if sw.code == http.StatusOK {
			ok.Inc()
		} else {
			l.r.metrics.apiRequests.WithLabelValues(op, strconv.Itoa(sw.code)).Inc()
		}
		duration.Observe(time.Since(start).Seconds())
	}
}

// acceptedKey is the context key of a local API connection's *accepted.
type acceptedKey struct{}

// accepted is when a connection was accepted; the first request on it
// takes it (a CNI plugin makes one request per connection), so that its
// latency includes the wait for a goroutine and the read of the request,
// which a busy router adds too.
type accepted struct {
	at    time.Time
	taken bool // one goroutine serves a connection's requests: no lock
}

// withAccepted is the local API server's ConnContext: it runs in the
// accept loop, as the connection is accepted.
func withAccepted(ctx context.Context, _ net.Conn) context.Context {
	return context.WithValue(ctx, acceptedKey{}, &accepted{at: time.Now()})
}

// requestStart is when req's latency starts: its connection's accept for
// the connection's first request, now for any other.
func requestStart(req *http.Request) time.Time {
	if a, ok := req.Context().Value(acceptedKey{}).(*accepted); ok && !a.taken {
		a.taken = true
		return a.at
	}
	return time.Now()
}

// jsonContentType is the Content-Type of every answer (one shared value,
// not a new slice per answer).
var jsonContentType = []string{"application/json"}

// writeJSON writes v as the JSON answer, with its length (one write; no
// chunked encoding).
func writeJSON(w http.ResponseWriter, code int, v any) {
	b, err := json.Marshal(v)
	if err != nil { // not for the API's own types; still an answer
		code, b = http.StatusInternalServerError, []byte(`{"code":"`+api.CodeInternal+`","error":"encoding the answer failed"}`)
	}
	b = append(b, '\n')
	h := w.Header()
	h["Content-Type"] = jsonContentType
	h["Content-Length"] = []string{strconv.Itoa(len(b))}
	w.WriteHeader(code)
	_, _ = w.Write(b)
}

func writeError(w http.ResponseWriter, status int, code, msg string) {
	writeJSON(w, status, api.ErrorBody{Code: code, Message: msg})
}

// bodyBufs are the buffers decode reads request bodies into.
var bodyBufs = sync.Pool{New: func() any { return new(bytes.Buffer) }}

// decode reads a JSON body of at most maxRequestBody bytes into v: the
// whole body into a pooled buffer, then one json.Unmarshal (no decoder
// and its buffers per request). What follows the JSON value, other than
// white space, makes it invalid.
func decode(w http.ResponseWriter, req *http.Request, v any) bool {
	buf := bodyBufs.Get().(*bytes.Buffer)
	defer func() {
		if buf.Cap() <= 64<<10 { // a GC's large list is not kept
			buf.Reset()
			bodyBufs.Put(buf)
		}
	}()
	buf.Reset()
	_, err := buf.ReadFrom(http.MaxBytesReader(w, req.Body, maxRequestBody))
	if err == nil && len(bytes.TrimSpace(buf.Bytes())) == 0 {
		err = io.EOF
	}
	if err == nil {
		err = json.Unmarshal(buf.Bytes(), v)
	}
	if err != nil {
		var tooBig *http.MaxBytesError
		switch {
		case errors.As(err, &tooBig):
			writeError(w, http.StatusRequestEntityTooLarge, api.CodeInvalid, fmt.Sprintf("request body is larger than %d bytes", maxRequestBody))
		case errors.Is(err, io.EOF):
			writeError(w, http.StatusBadRequest, api.CodeInvalid, "request body is empty: send a JSON object")
		default:
			writeError(w, http.StatusBadRequest, api.CodeInvalid, "request body is not valid JSON: "+err.Error())
		}
		return false
	}
	return true
}

func key(a api.Attachment) ipalloc.Key {
	return ipalloc.Key{ContainerID: a.ContainerID, IfName: a.IfName}
}

// allocation is the answer for k's address ip, in the ADD path's one
// address type (netip); JSON is the edge that makes text of it.
func (l *localAPI) allocation(k ipalloc.Key, ip netip.Addr, isNew bool) api.Allocation {
	net := l.r.net()
	return api.Allocation{
		Attachment: api.Attachment{ContainerID: k.ContainerID, IfName: k.IfName},
		Address:    netip.PrefixFrom(ip, l.r.ipam.Universe().Bits()),
		Gateway:    net.gateway.Addr(),
		Bridge:     l.r.cfg.Bridge,
		MTU:        net.mtu,
		New:        isNew,
	}
}

func (l *localAPI) notReady(w http.ResponseWriter) bool {
	if ok, reason := l.r.Ready(); !ok {
		// With CodeNotReady the message is the bare reason; clients word it.
		writeError(w, http.StatusServiceUnavailable, api.CodeNotReady, reason)
		return true
	}
	return false
}

func (l *localAPI) allocate(w http.ResponseWriter, req *http.Request) {
	var in api.AllocateRequest
	if !decode(w, req, &in) {
		return
	}
	if err := in.Attachment.Validate(); err != nil {
		writeError(w, http.StatusBadRequest, api.CodeInvalid, err.Error())
		return
	}
	if l.notReady(w) {
		return
	}
	k := key(in.Attachment)
	ctx, cancel := context.WithTimeout(req.Context(), allocateWait)
	defer cancel()
	ip, isNew, err := l.r.ipam.Allocate(ctx, k, ipalloc.Meta{Netns: in.Netns, PodNamespace: in.PodNamespace, PodName: in.PodName})
	switch {
	case errors.Is(err, ipalloc.ErrLeft):
		writeError(w, http.StatusServiceUnavailable, api.CodeNotReady, err.Error())
		return
	case errors.Is(err, ipalloc.ErrRemoved): // says what to do: weft reset
		writeError(w, http.StatusConflict, api.CodeConflict, err.Error())
		return
	case ipalloc.ErrIsExhausted(err):
		writeError(w, http.StatusServiceUnavailable, api.CodeExhausted, fmt.Sprintf("no address for %s: %v", k, err))
		return
	case err != nil:
		l.r.log.Error("allocation failed", "key", k, "err", err)
		writeError(w, http.StatusInternalServerError, api.CodeInternal, err.Error())
		return
	}
	if isNew {
		l.r.log.Info("allocated address", "container", k.ContainerID, "ifname", k.IfName, "address", ip,
			"pod", podName(in.PodNamespace, in.PodName))
	}
	// The pod may send once it has its answer: its source must be let
	// through the bridge's guard first (dataplane.go).
	if err := l.r.allowPodSourceOf(k, ip); err != nil {
		l.r.log.Error("guard: cannot let the pod's address through the bridge", "key", k, "address", ip, "err", err)
		writeError(w, http.StatusInternalServerError, api.CodeInternal, fmt.Sprintf("letting %s send from %s on the bridge: %v", k, ip, err))
		return
	}
	// Nor before the NetworkPolicies that select it are enforced.
	if l.r.policy != nil {
		pctx, pcancel := context.WithTimeout(req.Context(), admitWait)
		err := l.r.policy.admit(pctx, in.PodNamespace, in.PodName, ip)
		pcancel()
		if err != nil {
			l.r.log.Error("the pod's network policy is not in place; the runtime retries the ADD", "pod", podName(in.PodNamespace, in.PodName), "address", ip, "err", err)
			writeError(w, http.StatusServiceUnavailable, api.CodeNotReady, err.Error())
			return
		}
	}
	writeJSON(w, http.StatusOK, l.allocation(k, ip, isNew))
}

func podName(ns, name string) string {
	if name == "" {
		return ""
	}
	return ns + "/" + name
}

func (l *localAPI) lookup(w http.ResponseWriter, req *http.Request) {
	att := api.AttachmentFromQuery(req.URL.Query())
	if err := att.Validate(); err != nil {
		writeError(w, http.StatusBadRequest, api.CodeInvalid, err.Error())
		return
	}
	ip, ok := l.r.ipam.Lookup(key(att))
	if !ok {
		writeError(w, http.StatusNotFound, api.CodeNotFound, fmt.Sprintf("no address is allocated to %s", att))
		return
	}
	writeJSON(w, http.StatusOK, l.allocation(key(att), ip, false))
}

func (l *localAPI) release(w http.ResponseWriter, req *http.Request) {
	att := api.AttachmentFromQuery(req.URL.Query())
	if err := att.Validate(); err != nil {
		writeError(w, http.StatusBadRequest, api.CodeInvalid, err.Error())
		return
	}
	var prev netip.Addr
	if s := req.URL.Query().Get(api.QueryAddress); s != "" {
		p, err := netip.ParsePrefix(s) // the plugin's prevResult has a prefix length
		if err != nil {
			p, err = netip.ParsePrefix(s + "/32")
		}
		if err != nil || !p.Addr().Is4() {
			writeError(w, http.StatusBadRequest, api.CodeInvalid, fmt.Sprintf("%s=%q is not an IPv4 address", api.QueryAddress, s))
			return
		}
		prev = p.Addr()
	}
	ip, ok, err := l.r.ipam.Release(key(att))
	reclaimed := false
	if err == nil && !ok && prev.IsValid() {
		// Unknown here: its address may be one re-claimed from the
		// bridge after the state was lost.
		if ok, err = l.r.ipam.ReleaseReclaimed(prev); ok {
			ip, reclaimed = prev, true
			l.r.log.Info("released re-claimed address", "address", ip, "container", att.ContainerID, "ifname", att.IfName)
		}
	}
	if err != nil {
		l.r.log.Error("release failed", "key", att, "err", err)
		writeError(w, http.StatusInternalServerError, api.CodeInternal, err.Error())
		return
	}
	var gerr error
	switch {
	case reclaimed: // its entry's veth is unknown: the full reconcile drops it
		gerr = l.r.syncPodSources()
	case ok:
		if p, isPod := podSource(key(att), ip); isPod {
			gerr = l.r.withdrawPodSource(p)
		}
	}
	if gerr != nil {
		l.r.log.Warn("guard: withdrawing a released pod's source address; retried on the next resync", "err", gerr)
	}
	if ok && l.r.policy != nil {
		l.r.policy.forget(ip)
	}
	resp := api.ReleaseResponse{Released: ok}
	if ok {
		resp.Address = ip
		l.r.log.Info("released address", "container", att.ContainerID, "ifname", att.IfName, "address", ip)
	}
	writeJSON(w, http.StatusOK, resp)
}

func (l *localAPI) gc(w http.ResponseWriter, req *http.Request) {
	var in api.GCRequest
	if !decode(w, req, &in) {
		return
	}
	if in.Valid == nil {
		writeError(w, http.StatusBadRequest, api.CodeInvalid, `GC needs the list of valid attachments ("valid": [...]); an absent list would release every pod's address`)
		return
	}
	valid := make([]ipalloc.Key, 0, len(in.Valid))
	for i, a := range in.Valid {
		if err := a.Validate(); err != nil {
			writeError(w, http.StatusBadRequest, api.CodeInvalid, fmt.Sprintf("valid attachment %d: %v", i, err))
			return
		}
		valid = append(valid, key(a))
	}
	dropped, err := l.r.ipam.GC(valid)
	if err != nil {
		writeError(w, http.StatusInternalServerError, api.CodeInternal, err.Error())
		return
	}
	if err := l.r.syncPodSources(); err != nil {
		l.r.log.Warn("guard: withdrawing released pods' source addresses; retried on the next resync", "err", err)
	}
	resp := api.GCResponse{Released: []api.Allocation{}}
	for _, d := range dropped {
		if l.r.policy != nil {
			l.r.policy.forget(d.Address.Addr())
		}
		resp.Released = append(resp.Released, l.allocation(d.Key, d.Address.Addr(), false))
		l.r.log.Info("GC released address", "container", d.Key.ContainerID, "ifname", d.Key.IfName, "address", d.Address)
	}
	writeJSON(w, http.StatusOK, resp)
}

func (l *localAPI) ready(w http.ResponseWriter, _ *http.Request) {
	if ok, reason := l.r.Ready(); !ok {
		writeJSON(w, http.StatusServiceUnavailable, api.ErrorBody{Code: api.CodeNotReady, Message: reason})
		return
	}
	writeJSON(w, http.StatusOK, api.Readiness{Ready: true})
}

func (l *localAPI) rmpeer(w http.ResponseWriter, req *http.Request) {
	var in api.RmpeerRequest
	if !decode(w, req, &in) {
		return
	}
	if in.Peer == "" {
		writeError(w, http.StatusBadRequest, api.CodeInvalid, "rmpeer needs the name or nickname of the peer that is gone")
		return
	}
	name, err := l.r.resolvePeer(in.Peer)
	if err != nil {
		writeError(w, http.StatusBadRequest, api.CodeInvalid, err.Error())
		return
	}
	if err := l.r.ipam.PeerGone(name); err != nil {
		writeError(w, http.StatusBadRequest, api.CodeInvalid, err.Error())
		return
	}
	var size uint64
	for _, s := range l.r.ipam.Snapshot().Ring.Shares() {
		if s.Peer == name {
			size = s.Size
		}
	}
	msg := fmt.Sprintf("rmpeer of %s: taking over its ranges (%d IPs) once every live peer has stopped listening to it", name, size)
	if size == 0 {
		msg = fmt.Sprintf("rmpeer of %s: it owns no ranges now", name)
	}
	l.r.log.Info(msg, "by", "weft rmpeer")
	writeJSON(w, http.StatusOK, api.RmpeerResponse{Peer: string(name), Message: msg})
}

// leaveHoldPoll is how often leave asks again while the peer holds back.
const leaveHoldPoll = 100 * time.Millisecond

// leave is the allocator's Leave with the peers the mesh sees alive, asked
// again (until ctx ends) while the peer still holds back after its start
// (ipalloc.ErrHolding): that ends with one gossip exchange with its live
// peers, well within a reset's wait, so a weft reset right after a restart
// waits for it instead of failing.
func (r *Router) leave(ctx context.Context, force bool) (ipalloc.LeaveResult, error) {
	t := time.NewTicker(leaveHoldPoll)
	defer t.Stop()
	waited := false
	for {
		alive := r.alivePeers() // before the allocator's lock: the mesh calls into it
		res, err := r.ipam.Leave(ctx, func(p ipalloc.PeerName) bool { return alive[p] }, force)
		if !errors.Is(err, ipalloc.ErrHolding) {
			return res, err
		}
		if !waited {
			waited = true
			r.log.Info("weft reset: waiting until this peer has heard the ring from its live peers (it still holds back after its start)", "err", err)
		}
		select {
		case <-ctx.Done():
			return res, err
		case <-t.C:
		}
	}
}

// reset takes this peer out of the cluster (weft reset): the allocator
// hands every range to a live peer and waits for it to confirm; then the
// CNI config goes at once (the runtime must stop sending pods here), and
// the router tears the rest down and exits once this answer is written.
func (l *localAPI) reset(w http.ResponseWriter, req *http.Request) {
	var in api.ResetRequest
	if !decode(w, req, &in) {
		return
	}
	ctx, cancel := context.WithTimeout(req.Context(), resetWait)
	defer cancel()
	res, err := l.r.leave(ctx, in.Force)
	if err != nil {
		writeError(w, http.StatusConflict, api.CodeConflict, err.Error())
		return
	}
	l.r.setReady(false, "left the cluster (weft reset); tearing down")
	if _, _, err := removeConfList(l.r.cfg.CNIConfDir); err != nil {
		l.r.log.Error("weft reset: could not remove the CNI config", "err", err)
	}
	resp := api.ResetResponse{Heir: string(res.Heir), HeirNickname: l.r.nickname(string(res.Heir)), Addresses: res.Size, Dropped: len(res.Dropped)}
	var msg strings.Builder
	switch {
	case res.Heir == "":
		msg.WriteString("no other peer shares this ring: nothing to hand over")
	case res.Ranges == nil:
		fmt.Fprintf(&msg, "%s(%s) has confirmed the handover of this peer's ranges", res.Heir, resp.HeirNickname)
	default:
		fmt.Fprintf(&msg, "handed %d addresses to %s(%s), which has saved them", res.Size, res.Heir, resp.HeirNickname)
	}
	if n := countPods(res.Dropped); n > 0 {
		fmt.Fprintf(&msg, "; %d pod addresses dropped (--force)", n)
	}
	msg.WriteString("; removing the bridge, its nftables table, the CNI config and the state, then exiting. " +
		"This peer's name is now removed from the cluster: start a router here again only with a new name (the default, when the state is gone)")
	resp.Message = msg.String()
	l.r.log.Info("weft reset: "+resp.Message, "heir", res.Heir, "addresses", res.Size, "dropped", len(res.Dropped))
	writeJSON(w, http.StatusOK, resp)
	l.r.requestReset()
}

// countPods counts the allocations of pods (not the router's own).
func countPods(als []ipalloc.Allocation) int {
	n := 0
	for _, a := range als {
		if !a.Key.Internal() || a.Key.Reclaimed() {
			n++
		}
	}
	return n
}

// localAPILimits are the local API's: an allocation or a reset may wait
// up to allocateWait or resetWait for the mesh before it answers.
var localAPILimits = serverLimits{
	ReadHeaderTimeout: 10 * time.Second,
	ReadTimeout:       30 * time.Second,
	WriteTimeout:      max(allocateWait, resetWait) + 30*time.Second,
	IdleTimeout:       60 * time.Second,
	MaxHeaderBytes:    16 << 10,
	MaxConns:          128,
}

// checkSocketDir refuses a --socket directory that another user could
// change: whoever can write to it can replace the socket, and the CNI
// plugin would hand pods' addresses to, and take them from, whoever
// listens there. The directory and every directory above it must be owned
// by root (or by this process's user) and not writable by group or others;
// a directory above with the sticky bit (such as /tmp) is allowed, since
// nobody else can rename what is in it.
func checkSocketDir(dir string) error {
	dir = filepath.Clean(dir)
	uid := uint32(os.Geteuid())
	for d, first := dir, true; ; d, first = filepath.Dir(d), false {
		fi, err := os.Stat(d)
		if err != nil {
			return fmt.Errorf("checking the directory of --socket: %w", err)
		}
		st, ok := fi.Sys().(*syscall.Stat_t)
		if !ok {
			return fmt.Errorf("checking the directory of --socket: no owner for %s", d)
		}
		mode := fi.Mode()
		switch {
		case !fi.IsDir():
			return fmt.Errorf("the directory of --socket, %s, is not a directory", d)
		case st.Uid != 0 && st.Uid != uid:
			return fmt.Errorf("the directory %s (of --socket %s) is owned by user %d, not root: that user could replace the socket the CNI plugin talks to; use a directory only root can write, such as /run/weft (chown root), or choose another --socket", d, dir, st.Uid)
		case mode.Perm()&0o022 != 0 && (first || mode&os.ModeSticky == 0):
			return fmt.Errorf("the directory %s (of --socket %s) has mode %v: other users could replace the socket the CNI plugin talks to; use a directory only root can write, such as /run/weft (chmod go-w %s), or choose another --socket", d, dir, mode.Perm(), d)
		}
		if d == filepath.Dir(d) {
			return nil
		}
	}
}
