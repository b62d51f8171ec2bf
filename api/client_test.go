package api

import (
	"context"
	"errors"
	"net"
	"net/http"
	"path/filepath"
	"testing"
	"time"
)

// TestClientRoundTrip: the client writes one request on a new connection
// (Connection: close), reads the answer, and maps a router that is absent,
// or that does not answer before ctx ends, to ErrUnreachable.
func TestClientRoundTrip(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "api.sock")
	cl := NewClient(sock)
	if err := cl.Ready(context.Background()); !errors.Is(err, ErrUnreachable) {
		t.Fatalf("Ready without a router: %v, want ErrUnreachable", err)
	}
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	hang := make(chan struct{})
	defer close(hang)
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		switch {
		case !req.Close:
			http.Error(w, `{"code":"invalid","error":"want Connection: close"}`, http.StatusBadRequest)
		case req.URL.Path == PathReady:
			w.Write([]byte(`{"ready":true}`))
		case req.URL.Path == PathIP && req.Method == http.MethodPost:
			w.WriteHeader(http.StatusServiceUnavailable)
			w.Write([]byte(`{"code":"exhausted","error":"no space"}`))
		default:
			<-hang // a router that never answers
		}
	})}
	go srv.Serve(ln)
	defer srv.Close()

	if err := cl.Ready(context.Background()); err != nil {
		t.Fatalf("Ready: %v", err)
	}
	if _, err := cl.Allocate(context.Background(), AllocateRequest{Attachment: Attachment{ContainerID: "c", IfName: "eth0"}}); !IsCode(err, CodeExhausted) {
		t.Fatalf("Allocate: %v, want the router's exhausted error", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	start := time.Now()
	if _, err := cl.Lookup(ctx, Attachment{ContainerID: "c", IfName: "eth0"}); !errors.Is(err, ErrUnreachable) {
		t.Fatalf("Lookup on a router that does not answer: %v, want ErrUnreachable", err)
	}
	if d := time.Since(start); d > 20*time.Second {
		t.Fatalf("Lookup returned %v after its context ended", d)
	}
	// A cancel without a deadline ends the wait too.
	cctx, ccancel := context.WithCancel(context.Background())
	time.AfterFunc(100*time.Millisecond, ccancel)
	start = time.Now()
	if _, err := cl.Lookup(cctx, Attachment{ContainerID: "c", IfName: "eth0"}); !errors.Is(err, ErrUnreachable) {
		t.Fatalf("Lookup cancelled: %v, want ErrUnreachable", err)
	}
	if d := time.Since(start); d > 20*time.Second {
		t.Fatalf("Lookup returned %v after its context was cancelled", d)
	}
}
