package router

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
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
