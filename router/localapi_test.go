package router

import (
	"context"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/weft-net/weft/api"
)

// newTestRouter is a router with real state and allocator but no network
// setup: the local API and status logic above the bridge seam.
func newTestRouter(t testing.TB, rangeCIDR string) (*Router, *api.Client) {
	t.Helper()
	r, cl, _ := newTestRouterClock(t, rangeCIDR)
	return r, cl
}

// testClock is a clock that moves only when the test says.
type testClock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *testClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *testClock) Add(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
}

// newTestRouterClock is newTestRouter with the default --gc-grace and the
// IPAM's clock in the test's hands.
func newTestRouterClock(t testing.TB, rangeCIDR string) (*Router, *api.Client, *testClock) {
	t.Helper()
	c := validConfig(t)
	c.IPAllocRange = rangeCIDR
	v, err := c.Validate()
	if err != nil {
		t.Fatal(err)
	}
	r, err := New(v, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.db.Close() })
	clk := &testClock{now: time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC)}
	r.seams.now = clk.Now
	r.netState = netState{host: netip.MustParseAddr("10.250.0.1"), mtu: 1440, gateway: netip.MustParsePrefix("10.32.0.1/12")}
	if err := r.openIPAM(context.Background()); err != nil {
		t.Fatal(err)
	}
	ln, err := listenUnix(c.Socket)
	if err != nil {
		t.Fatal(err)
	}
	srv := newLocalAPIServer(r)
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })
	return r, api.NewClient(c.Socket), clk
}

// runAllocator runs r's allocator loop (Service.Run) until tb ends, and
// returns a context that ends with it.
func runAllocator(tb testing.TB, r *Router) context.Context {
	tb.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); r.ipam.Run(ctx, nil) }()
	tb.Cleanup(func() { cancel(); <-done })
	return ctx
}

func TestLocalAPI(t *testing.T) {
	r, cl, clk := newTestRouterClock(t, "10.32.0.0/12")
	ctx := context.Background()
	att := api.Attachment{ContainerID: "c1", IfName: "eth0"}

	if _, err := cl.Allocate(ctx, api.AllocateRequest{Attachment: att}); !api.IsCode(err, api.CodeNotReady) {
		t.Fatalf("allocate before ready: %v, want not-ready", err)
	}
	if err := cl.Ready(ctx); !api.IsCode(err, api.CodeNotReady) {
		t.Fatalf("Ready before ready: %v", err)
	}
	r.setReady(true, "")
	if err := cl.Ready(ctx); err != nil {
		t.Fatal(err)
	}

	a1, err := cl.Allocate(ctx, api.AllocateRequest{Attachment: att, PodNamespace: "default", PodName: "web"})
	if err != nil || !a1.New || a1.Gateway != netip.MustParseAddr("10.32.0.1") || a1.MTU != 1440 || a1.Address.Bits() != 12 {
		t.Fatalf("allocate: %+v, %v", a1, err)
	}
	a2, err := cl.Allocate(ctx, api.AllocateRequest{Attachment: att})
	if err != nil || a2.New || a2.Address != a1.Address {
		t.Fatalf("repeated allocate: %+v, %v; want same address %s, not new", a2, err, a1.Address)
	}
	other, err := cl.Allocate(ctx, api.AllocateRequest{Attachment: api.Attachment{ContainerID: "c1", IfName: "net1"}})
	if err != nil || other.Address == a1.Address {
		t.Fatalf("second interface of the same container: %+v, %v", other, err)
	}
	if got, err := cl.Lookup(ctx, att); err != nil || got.Address != a1.Address {
		t.Fatalf("lookup: %+v, %v", got, err)
	}

	rel, err := cl.Release(ctx, att)
	if err != nil || !rel.Released {
		t.Fatalf("release: %+v, %v", rel, err)
	}
	rel, err = cl.Release(ctx, att)
	if err != nil || rel.Released {
		t.Fatalf("second release: %+v, %v; want success, nothing released", rel, err)
	}
	if _, err := cl.Lookup(ctx, att); !api.IsCode(err, api.CodeNotFound) {
		t.Fatalf("lookup after release: %v", err)
	}

	// GC keeps what is listed and the gateway-like internal keys.
	for _, id := range []string{"k1", "k2", "k3"} {
		if _, err := cl.Allocate(ctx, api.AllocateRequest{Attachment: api.Attachment{ContainerID: id, IfName: "eth0"}}); err != nil {
			t.Fatal(err)
		}
	}
	keep := []api.Attachment{{ContainerID: "k2", IfName: "eth0"}}
	// Within --gc-grace of their ADDs (the runtime's list may predate
	// them), GC keeps them all.
	clk.Add(Defaults().GCGrace - time.Second)
	gc, err := cl.GC(ctx, keep)
	if err != nil || len(gc.Released) != 0 {
		t.Fatalf("GC within the grace released %v, %v; want nothing", gc, err)
	}
	clk.Add(2 * time.Second)
	gc, err = cl.GC(ctx, keep)
	if err != nil {
		t.Fatal(err)
	}
	var released []string
	for _, a := range gc.Released {
		released = append(released, a.ContainerID+"/"+a.IfName)
	}
	slices.Sort(released)
	if strings.Join(released, ",") != "c1/net1,k1/eth0,k3/eth0" {
		t.Fatalf("GC released %v", released)
	}
	if _, err := cl.Lookup(ctx, api.Attachment{ContainerID: "k2", IfName: "eth0"}); err != nil {
		t.Fatalf("GC released a listed attachment: %v", err)
	}
	if r.ipam.Stats().Allocated != 1 {
		t.Fatalf("after GC %d allocations, want 1", r.ipam.Stats().Allocated)
	}
}

func TestLocalAPIBadInput(t *testing.T) {
	r, cl := newTestRouter(t, "10.32.0.0/12")
	r.setReady(true, "")
	ctx := context.Background()
	for _, att := range []api.Attachment{
		{ContainerID: "", IfName: "eth0"},
		{ContainerID: strings.Repeat("a", 300), IfName: "eth0"},
		{ContainerID: "_weft_gateway", IfName: "weft"}, // internal keys are not reachable
		{ContainerID: "c", IfName: ""},
		{ContainerID: "c", IfName: "a/b"},
	} {
		if _, err := cl.Allocate(ctx, api.AllocateRequest{Attachment: att}); !api.IsCode(err, api.CodeInvalid) {
			t.Errorf("allocate %+v: %v, want invalid", att, err)
		}
		if _, err := cl.Release(ctx, att); !api.IsCode(err, api.CodeInvalid) {
			t.Errorf("release %+v: %v, want invalid", att, err)
		}
	}
	// Raw bodies: garbage, empty, a GC without a list.
	hc := &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "unix", cl.Socket())
	}}}
	for path, body := range map[string]string{api.PathIP: "{not json", api.PathGC: "{}", api.PathIP + "?x": "", api.PathIP + "?y": " \n ",
		api.PathIP + "?z": `{"containerID":"c","ifName":"eth0"} {"containerID":"d","ifName":"eth0"}`} { // one JSON value only
		resp, err := hc.Post("http://weft"+path, "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusBadRequest || !strings.Contains(string(b), `"code":"invalid"`) {
			t.Errorf("POST %s %q: %s %s", path, body, resp.Status, b)
		}
	}
	if r.ipam.Stats().Allocated != 0 {
		t.Fatalf("bad input allocated something")
	}
}

func TestLocalAPIExhausted(t *testing.T) {
	r, cl := newTestRouter(t, "10.32.0.0/28") // 16 addresses: network, broadcast, 14 usable
	r.setReady(true, "")
	ctx := context.Background()
	seen := map[netip.Prefix]bool{}
	for i := 0; ; i++ {
		a, err := cl.Allocate(ctx, api.AllocateRequest{Attachment: api.Attachment{ContainerID: "c" + string(rune('a'+i)), IfName: "eth0"}})
		if api.IsCode(err, api.CodeExhausted) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		if seen[a.Address] {
			t.Fatalf("%s handed out twice", a.Address)
		}
		seen[a.Address] = true
	}
	if len(seen) != 14 {
		t.Fatalf("handed out %d addresses of a /28, want 14", len(seen))
	}
}

func TestSocketMode(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "run", "weft.sock")
	ln, err := listenUnix(path)
	if err != nil {
		t.Fatal(err)
	}
	fi, err := os.Stat(path)
	if err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("socket mode %v, %v; want 0600", fi.Mode(), err)
	}
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			c.Close()
		}
	}()
	if _, err := listenUnix(path); err == nil || !strings.Contains(err.Error(), "another process") {
		t.Fatalf("second listener on a live socket: %v", err)
	}
	ln.Close()
	// A stale socket (nobody listening) is replaced.
	ln2, err := listenUnix(path)
	if err != nil {
		t.Fatalf("stale socket not replaced: %v", err)
	}
	ln2.Close()
	os.WriteFile(filepath.Join(dir, "file"), nil, 0o600)
	if _, err := listenUnix(filepath.Join(dir, "file")); err == nil {
		t.Fatal("a regular file was taken for a socket")
	}
}

// TestSocketDirChecked: the local API refuses a socket directory another
// user could change (world- or group-writable, sticky or not, or owned by
// another user, also further up), with a message that says what to do;
// before, the socket was made in any directory.
func TestSocketDirChecked(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: the test gives a directory to another user")
	}
	base := t.TempDir() // under /tmp: a sticky, world-writable parent is fine
	mk := func(name string, mode os.FileMode, uid int) string {
		d := filepath.Join(base, name)
		if err := os.Mkdir(d, 0o700); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(d, mode); err != nil {
			t.Fatal(err)
		}
		if err := os.Chown(d, uid, 0); err != nil {
			t.Fatal(err)
		}
		return d
	}
	for _, tc := range []struct {
		dir  string
		want string
	}{
		{mk("world", 0o777, 0), "has mode -rwxrwxrwx"},
		{mk("sticky", 0o777|os.ModeSticky, 0), "has mode"},
		{mk("group", 0o775, 0), "chmod go-w"},
		{mk("nobody", 0o755, 65534), "owned by user 65534, not root"},
		{filepath.Join(mk("above", 0o777, 0), "weft"), "above"},
	} {
		_, err := listenUnix(filepath.Join(tc.dir, "weft.sock"))
		if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), "--socket") {
			t.Errorf("%s: %v; want an error with %q", tc.dir, err, tc.want)
		}
	}
	ok := mk("ok", 0o755, 0)
	ln, err := listenUnix(filepath.Join(ok, "weft.sock"))
	if err != nil {
		t.Fatalf("a root-owned 0755 directory: %v", err)
	}
	ln.Close()
}
