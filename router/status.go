package router

import (
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"net"
	"net/http"
	"runtime"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/weft-net/weft/ipalloc"
	"github.com/weft-net/weft/mesh"
	"github.com/weft-net/weft/tunnel"
)

// Report is the JSON of GET /report: everything /status shows, and more.
type Report struct {
	Version string       `json:"version"`
	Router  RouterReport `json:"router"`
	IPAM    IPAMReport   `json:"ipam"`
	Policy  PolicyReport `json:"policy"`
}

// RouterReport describes this peer.
type RouterReport struct {
	Name     string `json:"name"`
	Nickname string `json:"nickname"`
	Host     string `json:"host"`
	Bridge   string `json:"bridge"`
	Gateway  string `json:"gateway"`
	MTU      int    `json:"mtu"`
	Encap    string `json:"encap"`
	// Encryption is the data plane's: whether it seals, with what, and the
	// trusted subnets.
	Encryption tunnel.Encryption `json:"encryption"`
	Ready      bool              `json:"ready"`
	Reason     string            `json:"reason,omitempty"`
	// Mesh is the peers, connections and targets of this peer.
	Mesh mesh.Report `json:"mesh"`
	// Connections are the mesh's connections with the data path to each
	// peer (how traffic is encapsulated to it).
	Connections []ConnReport `json:"connections"`
}

// IPAMReport describes the allocator.
type IPAMReport struct {
	Status string `json:"status"`
	Range  string `json:"range"`
	// Seed identifies the first claim the ring grew from: every peer of
	// one cluster shows the same; "none" before the first claim.
	Seed          string          `json:"seed"`
	DefaultSubnet string          `json:"defaultSubnet"`
	Owned         []string        `json:"owned"`
	Stats         ipalloc.Stats   `json:"stats"`
	Owners        []OwnerReport   `json:"owners"`
	Entries       []ipalloc.Entry `json:"entries"`
	Allocations   []AllocReport   `json:"allocations"`
	// Reclaims this peer runs (rmpeer, or a peer that left to it) that
	// still wait: removed peer -> the live peers not yet listening no more.
	Reclaims map[string][]string `json:"reclaims,omitempty"`
}

// OwnerReport is one line of /status/ipam.
type OwnerReport struct {
	Peer     string  `json:"peer"`
	Nickname string  `json:"nickname"`
	Size     uint64  `json:"size"`
	Percent  float64 `json:"percent"`
	Active   int     `json:"active"`
	Free     uint64  `json:"free"`
	Reach    bool    `json:"reachable"`
}

// AllocReport is one allocation.
type AllocReport struct {
	ContainerID string `json:"containerID"`
	IfName      string `json:"ifName"`
	Address     string `json:"address"`
	Pod         string `json:"pod,omitempty"`
	Created     string `json:"created,omitempty"`
}

// Report builds the current report.
func (r *Router) Report() Report {
	snap := r.ipam.Snapshot()
	net := r.net()
	ready, reason := r.Ready()
	rep := Report{
		Version: Version,
		Router: RouterReport{
			Name: r.name, Nickname: r.cfg.Nickname, Host: net.host.String(),
			Bridge: r.cfg.Bridge, MTU: net.mtu, Encap: string(r.cfg.EncapMode),
			Ready: ready, Reason: reason,
		},
		IPAM: IPAMReport{
			Status:        r.ipamStatus(snap),
			Range:         snap.Universe.String(),
			Seed:          snap.Ring.Seed.String(),
			DefaultSubnet: snap.Universe.String(),
			Stats:         snap.Stats,
			Entries:       snap.Ring.Entries,
			Owned:         []string{},
			Allocations:   []AllocReport{},
		},
	}
	rep.Policy = r.policyReport()
	if r.mesh != nil {
		rep.Router.Mesh = r.mesh.Report()
		rep.Router.Connections = r.connections()
	} else {
		rep.Router.Mesh = mesh.Report{Name: mesh.PeerName(r.name), Nickname: r.cfg.Nickname, PeerCount: 1}
	}
	if r.tunnel != nil {
		rep.Router.Encryption = r.tunnel.Encryption()
	}
	if net.gateway.IsValid() {
		rep.Router.Gateway = net.gateway.Addr().String()
	}
	for _, o := range snap.Owned {
		for _, c := range o.CIDRs() {
			rep.IPAM.Owned = append(rep.IPAM.Owned, c.String())
		}
	}
	active := 0
	for _, a := range snap.Allocations {
		if a.Key.Internal() && !a.Key.Reclaimed() { // re-claimed: most likely a pod
			continue
		}
		active++
		ar := AllocReport{ContainerID: a.Key.ContainerID, IfName: a.Key.IfName, Address: a.Address.String(), Pod: podName(a.PodNamespace, a.PodName)}
		if !a.Created.IsZero() {
			ar.Created = a.Created.Format("2006-01-02T15:04:05Z")
		}
		rep.IPAM.Allocations = append(rep.IPAM.Allocations, ar)
	}
	for x, waiting := range snap.Status.Reclaims {
		if len(waiting) == 0 {
			continue // done
		}
		if rep.IPAM.Reclaims == nil {
			rep.IPAM.Reclaims = map[string][]string{}
		}
		for _, q := range waiting {
			rep.IPAM.Reclaims[string(x)] = append(rep.IPAM.Reclaims[string(x)], string(q))
		}
	}
	total := uint64(snap.Universe.Bits())
	total = uint64(1) << (32 - total)
	for _, s := range snap.Ring.Shares() {
		o := OwnerReport{Peer: string(s.Peer), Nickname: r.nickname(string(s.Peer)), Size: s.Size, Free: s.Free,
			Percent: ipalloc.Percent(s.Size, total), Reach: r.reachable(string(s.Peer))}
		if s.Peer == snap.Self {
			o.Active = active
		} else if s.Size >= s.Free {
			o.Active = int(s.Size - s.Free) // as its owner last gossiped; includes its gateway
		}
		rep.IPAM.Owners = append(rep.IPAM.Owners, o)
	}
	return rep
}

func (r *Router) ipamStatus(snap ipalloc.Snapshot) string {
	st := snap.Status.String()
	if st != "waiting for space" || r.mesh == nil {
		return st
	}
	for _, sh := range snap.Ring.Shares() {
		if sh.Peer != snap.Self && sh.Free > 0 && r.reachable(string(sh.Peer)) {
			return st
		}
	}
	return "all ranges owned by unreachable peers - use 'weft rmpeer' if they are gone"
}

// reachable reports whether the mesh sees peer alive (or only suspected).
func (r *Router) reachable(peer string) bool {
	if peer == r.name {
		return true
	}
	if r.mesh == nil {
		return false
	}
	p, ok := r.mesh.Peer(mesh.PeerName(peer))
	return ok && (p.State == mesh.StateAlive || p.State == mesh.StateSuspect)
}

func (r *Router) nickname(peer string) string {
	if peer == r.name {
		return r.cfg.Nickname
	}
	if r.mesh != nil {
		if p, ok := r.mesh.Peer(mesh.PeerName(peer)); ok {
			return p.Nickname
		}
	}
	return ""
}

// WriteStatus writes the weave-like text of GET /status.
func WriteStatus(w io.Writer, rep Report) {
	line := func(k, v string) { fmt.Fprintf(w, "%15s: %s\n", k, v) }
	fmt.Fprintln(w)
	line("Version", fmt.Sprintf("%s (%s)", rep.Version, runtime.Version()))
	fmt.Fprintln(w)
	line("Service", "router")
	line("Name", fmt.Sprintf("%s(%s)", rep.Router.Name, rep.Router.Nickname))
	line("Host", rep.Router.Host)
	line("Bridge", fmt.Sprintf("%s (gateway %s, pod MTU %d)", rep.Router.Bridge, rep.Router.Gateway, rep.Router.MTU))
	line("Encapsulation", encapSummary(rep.Router.Encap, rep.Router.Connections))
	line("Encryption", rep.Router.Encryption.String())
	m := rep.Router.Mesh
	line("Peers", fmt.Sprint(m.PeerCount))
	line("Connections", fmt.Sprintf("%d (%d established)", len(m.Connections), m.Established))
	line("Targets", fmt.Sprint(len(m.Targets)))
	if rep.Router.Ready {
		line("Ready", "yes")
	} else {
		line("Ready", "no - "+rep.Router.Reason)
	}
	fmt.Fprintln(w)
	line("Service", "ipam")
	line("Status", rep.IPAM.Status)
	line("Range", rep.IPAM.Range)
	line("DefaultSubnet", rep.IPAM.DefaultSubnet)
	fmt.Fprintln(w)
	line("Service", "networkpolicy")
	line("Status", policySummary(rep.Policy))
	fmt.Fprintln(w)
}

// encapSummary is the Encapsulation line of /status: the configured mode
// and how many peers each data path serves, e.g. "auto (udp: 2 peers)".
func encapSummary(configured string, conns []ConnReport) string {
	counts := map[string]int{}
	for _, c := range conns {
		if c.Peer == "" {
			continue
		}
		switch {
		case c.Mode == "":
			counts["no common mode"]++
		case c.Kernel:
			counts[c.Mode+" (kernel)"]++
		default:
			counts[c.Mode]++
		}
	}
	if len(counts) == 0 {
		return configured
	}
	var parts []string
	for _, k := range slices.Sorted(maps.Keys(counts)) {
		n := counts[k]
		unit := "peers"
		if n == 1 {
			unit = "peer"
		}
		parts = append(parts, fmt.Sprintf("%s: %d %s", k, n, unit))
	}
	return configured + " (" + strings.Join(parts, ", ") + ")"
}

// WriteIPAM writes the text of GET /status/ipam: one line per owner.
func WriteIPAM(w io.Writer, rep Report) {
	for _, o := range rep.IPAM.Owners {
		name := o.Peer
		if o.Nickname != "" {
			name += "(" + o.Nickname + ")"
		}
		suffix := ""
		if !o.Reach {
			suffix = " - unreachable!"
		}
		fmt.Fprintf(w, "%-40s %8d IPs (%05.1f%% of total) (%d active)%s\n", name, o.Size, o.Percent, o.Active, suffix)
	}
	for _, x := range slices.Sorted(maps.Keys(rep.IPAM.Reclaims)) {
		fmt.Fprintf(w, "removing %s: waiting for %s to stop listening to it\n", x, strings.Join(rep.IPAM.Reclaims[x], ", "))
	}
}

// statusHandler serves the read-only status endpoints. Only GET and HEAD are
// answered, and, when the server listens on loopback, only requests whose
// Host is a loopback name (a web page cannot reach it by DNS rebinding).
func (r *Router) statusHandler(loopbackOnly bool) http.Handler {
	mux := http.NewServeMux()
	text := func(f func(io.Writer, Report)) http.HandlerFunc {
		return func(w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("Content-Type", "text/plain; charset=utf-8")
			f(w, r.Report())
		}
	}
	mux.HandleFunc("/status", text(WriteStatus))
	mux.HandleFunc("/status/ipam", text(WriteIPAM))
	mux.HandleFunc("/status/policy", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		WritePolicy(w, r.policyReport())
	})
	mux.HandleFunc("/status/peers", r.meshText((*mesh.Mesh).WriteStatusPeers))
	mux.HandleFunc("/status/connections", r.meshText(func(_ *mesh.Mesh, w io.Writer) error {
		return WriteConnections(w, r.connections())
	}))
	mux.HandleFunc("/report", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		_ = enc.Encode(r.Report())
	})
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) {
		fmt.Fprintln(w, "ok")
	})
	mux.HandleFunc("/readyz", func(w http.ResponseWriter, _ *http.Request) {
		if ok, reason := r.Ready(); !ok {
			http.Error(w, "not ready: "+reason, http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintln(w, "ready")
	})
	mux.Handle("/metrics", promhttp.HandlerFor(r.metrics.reg, promhttp.HandlerOpts{}))
	return http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		if req.Method != http.MethodGet && req.Method != http.MethodHead {
			w.Header().Set("Allow", "GET, HEAD")
			http.Error(w, "the status server is read-only: use GET (changes go through the local socket)", http.StatusMethodNotAllowed)
			return
		}
		if loopbackOnly && !isLoopbackHost(req.Host) {
			http.Error(w, "requests must name a loopback host (127.0.0.1, ::1 or localhost)", http.StatusForbidden)
			return
		}
		mux.ServeHTTP(w, req)
	})
}

// meshText serves a text view of the mesh.
func (r *Router) meshText(f func(*mesh.Mesh, io.Writer) error) http.HandlerFunc {
	return func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		if r.mesh == nil {
			http.Error(w, "the mesh has not started yet", http.StatusServiceUnavailable)
			return
		}
		_ = f(r.mesh, w)
	}
}

func isLoopbackHost(hostport string) bool {
	host := hostport
	if h, _, err := net.SplitHostPort(hostport); err == nil {
		host = h
	}
	host = strings.Trim(host, "[]")
	if strings.EqualFold(host, "localhost") {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// serverLimits bound what one client of an HTTP server can hold: a
// connection that sends nothing, sends slowly, reads slowly or stays idle
// is closed, and beyond MaxConns at once a new connection is closed at
// once (the status server may listen beyond loopback, where anyone can
// connect).
type serverLimits struct {
	ReadHeaderTimeout time.Duration // the request line and headers
	ReadTimeout       time.Duration // the whole request
	WriteTimeout      time.Duration // from the end of the headers to the end of the answer
	IdleTimeout       time.Duration // between requests on a kept-alive connection
	MaxHeaderBytes    int
	MaxConns          int
}

// statusLimits are the status server's: its answers are quick (a
// /metrics scrape of a large cluster included).
var statusLimits = serverLimits{
	ReadHeaderTimeout: 5 * time.Second,
	ReadTimeout:       10 * time.Second,
	WriteTimeout:      30 * time.Second,
	IdleTimeout:       30 * time.Second,
	MaxHeaderBytes:    16 << 10,
	MaxConns:          64,
}

// newServer is an http.Server for h with the limits' timeouts; serve it
// on limitListener(ln, lim.MaxConns).
func newServer(h http.Handler, lim serverLimits) *http.Server {
	return &http.Server{
		Handler:           h,
		ReadHeaderTimeout: lim.ReadHeaderTimeout,
		ReadTimeout:       lim.ReadTimeout,
		WriteTimeout:      lim.WriteTimeout,
		IdleTimeout:       lim.IdleTimeout,
		MaxHeaderBytes:    lim.MaxHeaderBytes,
	}
}

// limitListener accepts at most max connections at once; one more is
// closed as soon as it is accepted, so that a client holding many cannot
// queue the others behind it.
func limitListener(ln net.Listener, max int) net.Listener {
	return &capListener{Listener: ln, slots: make(chan struct{}, max)}
}

type capListener struct {
	net.Listener
	slots chan struct{}
}

func (l *capListener) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		select {
		case l.slots <- struct{}{}:
			return &capConn{Conn: c, release: func() { <-l.slots }}, nil
		default:
			c.Close()
		}
	}
}

type capConn struct {
	net.Conn
	once    sync.Once
	release func()
}

func (c *capConn) Close() error {
	err := c.Conn.Close()
	c.once.Do(c.release)
	return err
}
