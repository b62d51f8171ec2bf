// Command membench measures the memory of idle weft routers: a cluster of
// -nodes network namespaces (the namespace-cluster harness), a `weft
// router` process in each, joined by --peers, without and with a password.
// Once every router is ready it lets them gossip idle for -idle, then reads
// each router's VmRSS and VmHWM (/proc/<pid>/status) and, from its
// /metrics, the Go heap in use, the memory the runtime holds from the OS and
// the goroutines. With -cycles N it then runs N pod ADD/DEL cycles through
// the first router's local API (as the CNI plugin calls it: allocate, then
// release, a new attachment each time), idles again, and reads the figures
// again: a router that leaks grows here.
//
// It prints a Markdown table for docs/benchmarks.md on stdout and its
// progress on stderr. Needs root and `make build`. Everything it makes
// lives in namespaces of its own and is removed on exit, also on SIGINT and
// SIGTERM.
//
//	go run ./e2e/cmd/membench [-nodes 3] [-idle 60s] [-cycles 10000]
package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/weft-net/weft/api"
	"github.com/weft-net/weft/internal/nscluster"
)

func main() { os.Exit(run()) }

func run() int {
	nodes := flag.Int("nodes", 3, "routers in the cluster")
	idle := flag.Duration("idle", 60*time.Second, "idle gossip before each reading")
	cycles := flag.Int("cycles", 0, "pod ADD/DEL cycles through the first router's local API between two readings (0: none)")
	verbose := flag.Bool("v", false, "log what the harness does on stderr")
	flag.Parse()
	level := slog.LevelWarn
	if *verbose {
		level = slog.LevelDebug
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	fmt.Printf("| password | reading | router | VmRSS MiB | VmHWM MiB | anonymous MiB | file MiB | Go heap in use MiB | Go runtime from OS MiB | goroutines |\n")
	fmt.Printf("|---|---|---|---:|---:|---:|---:|---:|---:|---:|\n")
	for _, pw := range []bool{false, true} {
		if err := measure(ctx, log, *nodes, pw, *idle, *cycles); err != nil {
			fmt.Fprintln(os.Stderr, "membench:", err)
			return 1
		}
	}
	return 0
}

func measure(ctx context.Context, log *slog.Logger, nodes int, password bool, idle time.Duration, cycles int) error {
	r, err := nscluster.NewRun(nscluster.Options{Log: log})
	if err != nil {
		return err
	}
	defer r.Close()
	c, err := r.NewCluster(ctx, nscluster.ClusterOpts{Nodes: nodes})
	if err != nil {
		return err
	}
	var all []string
	for _, n := range c.Nodes {
		all = append(all, n.UnderlayIP.String())
	}
	args := []string{"--peers", strings.Join(all, ","), "--log-level", "warn"}
	if password {
		f := filepath.Join(r.Dir(), "password")
		if err := os.WriteFile(f, []byte("membench password\n"), 0o600); err != nil {
			return err
		}
		args = append(args, "--password-file", f)
	}
	for _, n := range c.Nodes {
		if _, err := n.StartRouter(args...); err != nil {
			return err
		}
	}
	for _, n := range c.Nodes {
		if err := n.WaitReady(ctx); err != nil {
			return fmt.Errorf("%s: %w\n%s", n.Name, err, n.Router().LogTail(20))
		}
	}
	pw := "no"
	if password {
		pw = "yes"
	}
	read := func(what string) error {
		fmt.Fprintf(os.Stderr, "membench: password %s: idle %s before reading %q\n", pw, idle, what)
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(idle):
		}
		for _, n := range c.Nodes {
			m, err := readMem(ctx, n)
			if err != nil {
				return fmt.Errorf("%s: %w", n.Name, err)
			}
			fmt.Printf("| %s | %s | %s | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %d |\n", pw, what, n.Name,
				mib(m.rss), mib(m.hwm), mib(m.anon), mib(m.file), mib(m.heapInuse), mib(m.sys-m.released), m.goroutines)
		}
		return nil
	}
	if err := read("idle"); err != nil {
		return err
	}
	if cycles == 0 {
		return nil
	}
	cl := api.NewClient(c.Nodes[0].Socket)
	start := time.Now()
	for i := range cycles {
		att := api.Attachment{ContainerID: fmt.Sprintf("membench-%d", i), IfName: "eth0"}
		if _, err := cl.Allocate(ctx, api.AllocateRequest{Attachment: att, PodNamespace: "default", PodName: att.ContainerID}); err != nil {
			return fmt.Errorf("cycle %d: allocate: %w", i, err)
		}
		if _, err := cl.Release(ctx, att); err != nil {
			return fmt.Errorf("cycle %d: release: %w", i, err)
		}
	}
	fmt.Fprintf(os.Stderr, "membench: %d ADD/DEL cycles in %s\n", cycles, time.Since(start).Round(time.Millisecond))
	return read(fmt.Sprintf("after %d ADD/DEL", cycles))
}

type mem struct {
	rss, hwm, anon, file     float64 // bytes
	heapInuse, sys, released float64 // bytes, from /metrics
	goroutines               int
}

func mib(b float64) float64 { return b / (1 << 20) }

func readMem(ctx context.Context, n *nscluster.Node) (mem, error) {
	var m mem
	status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", n.Router().Proc().Pid()))
	if err != nil {
		return m, err
	}
	s := bufio.NewScanner(bytes.NewReader(status))
	for s.Scan() {
		f := strings.Fields(s.Text())
		if len(f) == 3 && f[2] == "kB" {
			v, _ := strconv.ParseFloat(f[1], 64)
			switch f[0] {
			case "VmRSS:":
				m.rss = v * 1024
			case "VmHWM:":
				m.hwm = v * 1024
			case "RssAnon:":
				m.anon = v * 1024
			case "RssFile:":
				m.file = v * 1024
			}
		}
	}
	data, err := n.HTTPGet(ctx, "/metrics")
	if err != nil {
		return m, err
	}
	got := map[string]float64{}
	s = bufio.NewScanner(bytes.NewReader(data))
	for s.Scan() {
		f := strings.Fields(s.Text())
		if len(f) == 2 {
			v, err := strconv.ParseFloat(f[1], 64)
			if err == nil {
				got[f[0]] = v
			}
		}
	}
	for _, k := range []string{"go_memstats_heap_inuse_bytes", "go_memstats_sys_bytes", "go_memstats_heap_released_bytes", "go_goroutines"} {
		if _, ok := got[k]; !ok {
			return m, errors.New("/metrics has no " + k)
		}
	}
	m.heapInuse, m.sys, m.released = got["go_memstats_heap_inuse_bytes"], got["go_memstats_sys_bytes"], got["go_memstats_heap_released_bytes"]
	m.goroutines = int(got["go_goroutines"])
	return m, nil
}
