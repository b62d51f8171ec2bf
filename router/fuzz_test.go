package router

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/weft-net/weft/api"
)

// FuzzLocalAPI sends arbitrary requests to the local API: it must answer
// every one with a JSON error or a success, never panic, never 500, and
// never hand out an address for an invalid attachment.
func FuzzLocalAPI(f *testing.F) {
	f.Add("POST", api.PathIP, `{"containerID":"c1","ifName":"eth0"}`)
	f.Add("POST", api.PathIP, `{"containerID":"","ifName":"eth0"}`)
	f.Add("DELETE", api.PathIP+"?containerID=c1&ifName=eth0", "")
	f.Add("GET", api.PathIP+"?containerID=c1", "")
	f.Add("POST", api.PathGC, `{"valid":[{"containerID":"c1","ifName":"eth0"}]}`)
	f.Add("POST", api.PathGC, `{"valid":null}`)
	f.Add("GET", api.PathReady, "")
	f.Add("PUT", "/v1/../v1/ip", "\x00\xff")

	r := fuzzRouter(f)
	r.setReady(true, "")
	h := (&localAPI{r: r}).handler()

	f.Fuzz(func(t *testing.T, method, target, body string) {
		if !strings.HasPrefix(target, "/") || strings.ContainsAny(method, " \t\r\n") || method == "" {
			return
		}
		req, err := http.NewRequest(method, "http://weft"+target, strings.NewReader(body))
		if err != nil {
			return
		}
		w := httptest.NewRecorder()
		h.ServeHTTP(w, req)
		if w.Code >= 500 && !strings.Contains(w.Body.String(), `"code":"exhausted"`) {
			t.Fatalf("%s %s %q: %d %s", method, target, body, w.Code, w.Body)
		}
		if w.Code/100 != 2 && !strings.Contains(w.Body.String(), `"error"`) && w.Code/100 != 3 { // ServeMux redirects unclean paths
			t.Fatalf("%s %s %q: %d without a JSON error: %s", method, target, body, w.Code, w.Body)
		}
		for _, a := range r.ipam.Snapshot().Allocations {
			if a.Key.Internal() {
				continue
			}
			if err := (api.Attachment{ContainerID: a.Key.ContainerID, IfName: a.Key.IfName}).Validate(); err != nil {
				t.Fatalf("an invalid attachment holds an address: %v", err)
			}
		}
	})
}
