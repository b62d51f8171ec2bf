// Command netprobe is the test pods' program in e2e/kubenodes: an HTTP
// server that answers every request with its pod's name and the address the
// request came from, so that a harness dialling from another pod's network
// namespace sees who answered and what source address arrived.
package main

import (
	"flag"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/signal"
	"syscall"
)

func main() {
	addr := flag.String("addr", ":8080", "listen address")
	flag.Parse()
	name, _ := os.Hostname()
	if n := os.Getenv("POD_NAME"); n != "" {
		name = n
	}
	ln, err := net.Listen("tcp", *addr)
	if err != nil {
		fmt.Fprintf(os.Stderr, "netprobe: %v\n", err)
		os.Exit(1)
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "%s %s\n", name, r.RemoteAddr)
	})}
	go func() {
		sigs := make(chan os.Signal, 1)
		signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT)
		<-sigs
		srv.Close()
	}()
	if err := srv.Serve(ln); err != nil && err != http.ErrServerClosed {
		fmt.Fprintf(os.Stderr, "netprobe: %v\n", err)
		os.Exit(1)
	}
}
