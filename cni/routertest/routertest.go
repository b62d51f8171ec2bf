// Package routertest serves the weft router's local API on a unix socket
// from an in-memory map: a seam fake for the CNI plugin's tests, not the
// allocator (no ranges, no persistence, no mesh).
package routertest

import (
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"testing"

	"github.com/weft-net/weft/api"
)

// Router is a fake weft router. Its exported fields may be changed before
// the first request; after that, use Set.
type Router struct {
	Socket string // where it listens
	Bridge string // the bridge name it hands out
	MTU    int    // the MTU it hands out

	mu       sync.Mutex
	allocs   map[api.Attachment]api.Allocation // guarded by mu
	requests []api.AllocateRequest             // guarded by mu
	next     netip.Addr                        // guarded by mu
	gcValid  [][]api.Attachment                // guarded by mu
	prevs    []string                          // address= of releases, guarded by mu

	// NotReady, when not empty, makes the router answer "not ready" with
	// this reason. Guarded by mu: change it through Set.
	NotReady string
	// Exhausted makes new allocations fail. Guarded by mu: change it through Set.
	Exhausted bool
}

// ShortTempDir is a fresh directory with a path short enough for a unix
// socket (t.TempDir embeds the test name, which can be long), removed when
// the test ends.
func ShortTempDir(t testing.TB) string {
	dir, err := os.MkdirTemp("", "weftcni")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

// Start serves a fake router on a fresh socket until the test ends.
func Start(t testing.TB, bridge string, mtu int) *Router {
	t.Helper()
	f := &Router{
		Socket: filepath.Join(ShortTempDir(t), "weft.sock"),
		Bridge: bridge,
		MTU:    mtu,
		allocs: map[api.Attachment]api.Allocation{},
		next:   netip.MustParseAddr("10.32.0.2"),
	}
	l, err := net.Listen("unix", f.Socket)
	if err != nil {
		t.Fatalf("fake router: %v", err)
	}
	srv := &http.Server{Handler: f.handler()}
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := srv.Serve(l); err != nil && !errors.Is(err, http.ErrServerClosed) {
			t.Errorf("fake router: %v", err)
		}
	}()
	t.Cleanup(func() {
		srv.Close()
		<-done
	})
	return f
}

func (f *Router) handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST "+api.PathIP, f.allocate)
	mux.HandleFunc("GET "+api.PathIP, f.lookup)
	mux.HandleFunc("DELETE "+api.PathIP, f.release)
	mux.HandleFunc("POST "+api.PathGC, f.gc)
	mux.HandleFunc("GET "+api.PathReady, f.ready)
	return mux
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

func writeErr(w http.ResponseWriter, status int, code, msg string) {
	writeJSON(w, status, api.ErrorBody{Code: code, Message: msg})
}

func (f *Router) allocate(w http.ResponseWriter, req *http.Request) {
	var in api.AllocateRequest
	if err := json.NewDecoder(req.Body).Decode(&in); err != nil {
		writeErr(w, http.StatusBadRequest, api.CodeInvalid, err.Error())
		return
	}
	if err := in.Attachment.Validate(); err != nil {
		writeErr(w, http.StatusBadRequest, api.CodeInvalid, err.Error())
		return
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.requests = append(f.requests, in)
	if f.NotReady != "" {
		writeErr(w, http.StatusServiceUnavailable, api.CodeNotReady, f.NotReady)
		return
	}
	if a, ok := f.allocs[in.Attachment]; ok {
		a.New = false
		writeJSON(w, http.StatusOK, a)
		return
	}
	if f.Exhausted {
		writeErr(w, http.StatusServiceUnavailable, api.CodeExhausted, "no address for "+in.Attachment.String()+": the range is full")
		return
	}
	a := api.Allocation{
		Attachment: in.Attachment,
		Address:    netip.PrefixFrom(f.next, 12),
		Gateway:    netip.MustParseAddr("10.32.0.1"),
		Bridge:     f.Bridge,
		MTU:        f.MTU,
	}
	f.next = f.next.Next()
	f.allocs[in.Attachment] = a
	a.New = true
	writeJSON(w, http.StatusOK, a)
}

func (f *Router) lookup(w http.ResponseWriter, req *http.Request) {
	att := api.AttachmentFromQuery(req.URL.Query())
	f.mu.Lock()
	defer f.mu.Unlock()
	a, ok := f.allocs[att]
	if !ok {
		writeErr(w, http.StatusNotFound, api.CodeNotFound, fmt.Sprintf("no address is allocated to %s", att))
		return
	}
	writeJSON(w, http.StatusOK, a)
}

func (f *Router) release(w http.ResponseWriter, req *http.Request) {
	att := api.AttachmentFromQuery(req.URL.Query())
	f.mu.Lock()
	defer f.mu.Unlock()
	a, ok := f.allocs[att]
	delete(f.allocs, att)
	f.prevs = append(f.prevs, req.URL.Query().Get(api.QueryAddress))
	writeJSON(w, http.StatusOK, api.ReleaseResponse{Released: ok, Address: a.Address.Addr()})
}

func (f *Router) gc(w http.ResponseWriter, req *http.Request) {
	var in api.GCRequest
	if err := json.NewDecoder(req.Body).Decode(&in); err != nil || in.Valid == nil {
		writeErr(w, http.StatusBadRequest, api.CodeInvalid, "GC needs a valid list")
		return
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.gcValid = append(f.gcValid, in.Valid)
	keep := map[api.Attachment]bool{}
	for _, a := range in.Valid {
		keep[a] = true
	}
	resp := api.GCResponse{Released: []api.Allocation{}}
	for att, a := range f.allocs {
		if !keep[att] {
			delete(f.allocs, att)
			resp.Released = append(resp.Released, a)
		}
	}
	writeJSON(w, http.StatusOK, resp)
}

func (f *Router) ready(w http.ResponseWriter, _ *http.Request) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.NotReady != "" {
		writeErr(w, http.StatusServiceUnavailable, api.CodeNotReady, f.NotReady)
		return
	}
	writeJSON(w, http.StatusOK, api.Readiness{Ready: true})
}

// Set changes the fake's state under its lock.
func (f *Router) Set(fn func(f *Router)) {
	f.mu.Lock()
	defer f.mu.Unlock()
	fn(f)
}

// Allocation returns the fake's allocation of att, if any.
func (f *Router) Allocation(att api.Attachment) (api.Allocation, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	a, ok := f.allocs[att]
	return a, ok
}

// ReleasePrevs lists the prevResult address (the address= query; "" when
// none) of every release, in order.
func (f *Router) ReleasePrevs() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.prevs)
}

// LastGC is the valid list of the last GC call, and how many calls there were.
func (f *Router) LastGC() ([]api.Attachment, int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.gcValid) == 0 {
		return nil, 0
	}
	return f.gcValid[len(f.gcValid)-1], len(f.gcValid)
}

// Requests are the allocation requests the fake has received.
func (f *Router) Requests() []api.AllocateRequest {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]api.AllocateRequest(nil), f.requests...)
}
