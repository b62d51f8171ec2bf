package router

import (
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/weft-net/weft/mesh"
)

func TestStatusServer(t *testing.T) {
	r, _ := newTestRouter(t, "10.32.0.0/12")
	r.cfg.Nickname = "node1"
	r.setReady(true, "")
	h := r.statusHandler(true)
	get := func(method, target, host string) (int, string) {
		req := httptest.NewRequest(method, target, nil)
		req.Host = host
		w := httptest.NewRecorder()
		h.ServeHTTP(w, req)
		b, _ := io.ReadAll(w.Result().Body)
		return w.Code, string(b)
	}
	code, body := get("GET", "/status", "127.0.0.1:6784")
	for _, want := range []string{"Service: router", "Name: " + r.Name() + "(node1)", "Peers: 1", "Service: ipam", "Status: ready", "Range: 10.32.0.0/12", "DefaultSubnet: 10.32.0.0/12"} {
		if code != 200 || !strings.Contains(body, want) {
			t.Errorf("/status lacks %q:\n%s", want, body)
		}
	}
	code, body = get("GET", "/status/ipam", "localhost:6784")
	if code != 200 || !strings.Contains(body, "(node1)") || !strings.Contains(body, "1048576 IPs (100.0% of total) (0 active)") {
		t.Errorf("/status/ipam:\n%s", body)
	}
	if code, body = get("GET", "/report", "[::1]:6784"); code != 200 || !strings.Contains(body, `"range": "10.32.0.0/12"`) {
		t.Errorf("/report: %d\n%s", code, body)
	}
	if code, _ = get("GET", "/readyz", "127.0.0.1"); code != 200 {
		t.Errorf("/readyz = %d", code)
	}
	if code, body = get("GET", "/metrics", "127.0.0.1"); code != 200 || !strings.Contains(body, `weft_ipam_addresses{state="owned"} 1.048576e+06`) {
		t.Errorf("/metrics: %d\n%s", code, body)
	}
	if code, _ = get("POST", "/status", "127.0.0.1"); code != http.StatusMethodNotAllowed {
		t.Errorf("POST /status = %d, want 405", code)
	}
	if code, _ = get("GET", "/status", "evil.example.com"); code != http.StatusForbidden {
		t.Errorf("GET with a foreign Host = %d, want 403", code)
	}
	r.setReady(false, "bridge missing")
	if code, body = get("GET", "/readyz", "127.0.0.1"); code != 503 || !strings.Contains(body, "bridge missing") {
		t.Errorf("/readyz when not ready = %d %s", code, body)
	}
}

// TestServerLimits: a client of the status server cannot keep connections
// forever: one that sends nothing, one that stops halfway through its
// headers and one left idle after a request are all closed, and while
// MaxConns are busy a new connection is closed at once instead of waiting.
// (Before, the status server had only a header timeout and no cap.)
func TestServerLimits(t *testing.T) {
	// ReadTimeout is long, so that the header and idle timeouts are what
	// closes (http.Server falls back to ReadTimeout for both).
	lim := serverLimits{ReadHeaderTimeout: 300 * time.Millisecond, ReadTimeout: 30 * time.Second, WriteTimeout: 30 * time.Second, IdleTimeout: 300 * time.Millisecond, MaxHeaderBytes: 4 << 10, MaxConns: 3}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	hold := make(chan struct{})
	var held sync.WaitGroup
	srv := newServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		if req.URL.Path == "/hold" {
			held.Done()
			<-hold
		}
		io.WriteString(w, "ok")
	}), lim)
	capped := limitListener(ln, lim.MaxConns).(*capListener)
	done := make(chan error, 1)
	go func() { done <- srv.Serve(capped) }()
	defer func() {
		srv.Close()
		<-done
	}()
	dial := func() net.Conn {
		c, err := net.Dial("tcp", ln.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	// slotsFree waits until the server has released every slot: a client
	// sees its connection closed a moment before the server's Close
	// gives the slot back, so a dial at once may still find it taken.
	slotsFree := func() {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second)
		for len(capped.slots) > 0 {
			if time.Now().After(deadline) {
				t.Fatalf("%d of %d connection slots still taken after every client was closed", len(capped.slots), lim.MaxConns)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	// closedWithin says whether the server closes c within d.
	closedWithin := func(c net.Conn, d time.Duration) bool {
		c.SetReadDeadline(time.Now().Add(d))
		_, err := io.ReadAll(c)
		var ne net.Error
		return !(errors.As(err, &ne) && ne.Timeout())
	}

	// Three requests in progress hold every slot; a fourth connection is
	// closed at once.
	held.Add(3)
	var busy []net.Conn
	for range 3 {
		c := dial()
		c.Write([]byte("GET /hold HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"))
		busy = append(busy, c)
	}
	held.Wait()
	if !closedWithin(dial(), 5*time.Second) {
		t.Error("a connection past MaxConns was not closed while the others were busy")
	}
	close(hold)
	for _, c := range busy {
		c.SetReadDeadline(time.Now().Add(5 * time.Second))
		if b, _ := io.ReadAll(c); !strings.Contains(string(b), "200 OK") {
			t.Errorf("a held request: %q", b)
		}
	}
	slotsFree()

	// The timeouts.
	silent, partial, idle := dial(), dial(), dial()
	partial.Write([]byte("GET /status HTTP/1.1\r\nHost: 127"))
	idle.Write([]byte("GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"))
	buf := make([]byte, 512)
	idle.SetReadDeadline(time.Now().Add(5 * time.Second))
	if n, err := idle.Read(buf); err != nil || !strings.Contains(string(buf[:n]), "200 OK") {
		t.Fatalf("the request before idling: %q, %v", buf[:n], err)
	}
	for name, c := range map[string]net.Conn{"silent": silent, "partial headers": partial, "idle": idle} {
		if !closedWithin(c, 10*time.Second) {
			t.Errorf("the %s connection was kept open", name)
		}
	}
	slotsFree()
	// The slots are free again.
	c := dial()
	c.Write([]byte("GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"))
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if b, _ := io.ReadAll(c); !strings.Contains(string(b), "200 OK") {
		t.Errorf("after the others closed: %q", b)
	}
}

// TestStatusLimitsSet: the production servers have every timeout and a cap.
func TestStatusLimitsSet(t *testing.T) {
	for name, l := range map[string]serverLimits{"status": statusLimits, "local API": localAPILimits} {
		if l.ReadHeaderTimeout <= 0 || l.ReadTimeout <= 0 || l.WriteTimeout <= 0 || l.IdleTimeout <= 0 || l.MaxConns <= 0 || l.MaxHeaderBytes <= 0 {
			t.Errorf("%s limits incomplete: %+v", name, l)
		}
	}
	if localAPILimits.WriteTimeout <= allocateWait || localAPILimits.WriteTimeout <= resetWait {
		t.Errorf("the local API's write timeout %s would cut an allocation that waits %s", localAPILimits.WriteTimeout, allocateWait)
	}
}

// TestWriteConnectionsReason: `weft status connections` names the kernel
// VXLAN path and says why each peer got its mode.
func TestWriteConnectionsReason(t *testing.T) {
	conns := []ConnReport{
		{Connection: mesh.Connection{Address: "10.250.0.2:6783", Outcome: "established", State: "alive", Peer: "aa", Nick: "n1"},
			Mode: "vxlan", Kernel: true, Reason: "no password"},
		{Connection: mesh.Connection{Address: "10.250.0.3:6783", Outcome: "established", State: "alive", Peer: "bb", Nick: "n2"},
			Mode: "udp", Encrypted: true, Reason: "encrypted: outside trusted subnets"},
		{Connection: mesh.Connection{Address: "10.250.0.4:6783", Outcome: "established", State: "alive", Peer: "cc", Nick: "n3"},
			Mode: "udp", Reason: "vxlan path down since 10:02:03: no answer to 4 probes in a row", Path: "down since 10:02:03: no answer to 4 probes in a row"},
		{Connection: mesh.Connection{Address: "10.250.0.5:6783", Outcome: "established", State: "alive", Peer: "dd", Nick: "n4"},
			Mode: "vxlan", Kernel: true, Reason: "--encap vxlan, no password", Path: "down since 10:02:03: no answer to 4 probes in a row"},
	}
	var b strings.Builder
	if err := WriteConnections(&b, conns); err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(b.String()), "\n")
	if len(lines) != 4 {
		t.Fatalf("%d lines, want 4:\n%s", len(lines), b.String())
	}
	for i, want := range [][]string{{"vxlan (kernel)", "unencrypted", "aa(n1)", "no password"}, {"udp", "encrypted", "bb(n2)", "encrypted: outside trusted subnets"},
		{"udp", "cc(n3)", "vxlan path down since 10:02:03: no answer"}, {"vxlan (kernel)", "dd(n4)", "--encap vxlan, no password; vxlan path down since"}} {
		for _, w := range want {
			if !strings.Contains(lines[i], w) {
				t.Errorf("line %d %q lacks %q", i, lines[i], w)
			}
		}
	}
	if strings.Count(lines[2], "vxlan path down") != 1 {
		t.Errorf("line 2 %q names the path twice", lines[2])
	}
	if got := encapSummary("auto", conns[:2]); got != "auto (udp: 1 peer, vxlan (kernel): 1 peer)" {
		t.Errorf("encapSummary = %q", got)
	}
}
