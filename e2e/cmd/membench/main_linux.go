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
// With -sample D it is a soak: during each idle period it reads the figures
// of every router every D and, at the end of the period, prints per router
// the series' start, end, minimum, maximum and least-squares slope (MiB per
// hour) of VmRSS, the Go heap in use and the goroutines; -series FILE keeps
// every sample as CSV. -password no|yes|both picks the runs.
//
// It prints a Markdown table for docs/benchmarks.md on stdout and its
// progress on stderr. Needs root and `make build`. Everything it makes
// lives in namespaces of its own and is removed on exit, also on SIGINT and
// SIGTERM.
//
//	go run ./e2e/cmd/membench [-nodes 3] [-idle 60s] [-cycles 10000]
//	go run ./e2e/cmd/membench -password no -idle 60m -sample 1m -series soak.csv
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
	warmCycles := flag.Int("warmup-cycles", 0, "pod ADD/DEL cycles through the first router's local API before the first reading (0: none): "+
		"the runtime's heap and page cache reach their working size, so that the two readings compare like with like")
	verbose := flag.Bool("v", false, "log what the harness does on stderr")
	passwords := flag.String("password", "both", "runs without (no), with (yes) or without and then with (both) a password")
	sample := flag.Duration("sample", 0, "soak: read every router every this long during each idle period and print the series' figures (0: one reading at the end)")
	series := flag.String("series", "", "soak: write every sample to this CSV file")
	warmup := flag.Int("warmup", 0, "soak: leave out the first N samples of each series from its figures (they stay in the CSV)")
	flag.Parse()
	var pws []bool
	switch *passwords {
	case "no":
		pws = []bool{false}
	case "yes":
		pws = []bool{true}
	case "both":
		pws = []bool{false, true}
	default:
		fmt.Fprintf(os.Stderr, "membench: -password %q: want no, yes or both\n", *passwords)
		return 2
	}
	if *sample < 0 || (*sample > 0 && *sample > *idle) {
		fmt.Fprintf(os.Stderr, "membench: -sample %s: want 0 or a period no longer than -idle (%s)\n", *sample, *idle)
		return 2
	}
	var csv *os.File
	if *series != "" {
		f, err := os.Create(*series)
		if err != nil {
			fmt.Fprintln(os.Stderr, "membench:", err)
			return 1
		}
		defer f.Close()
		fmt.Fprintln(f, "password,reading,router,seconds,vmrss_bytes,anon_bytes,file_bytes,heap_live_bytes,heap_inuse_bytes,runtime_from_os_bytes,goroutines")
		csv = f
	}
	soak := soakOpts{every: *sample, csv: csv, warmup: *warmup}
	level := slog.LevelWarn
	if *verbose {
		level = slog.LevelDebug
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	fmt.Printf("| password | reading | router | VmRSS MiB | VmHWM MiB | anonymous MiB | file MiB | Go heap live MiB | Go heap in use MiB | Go runtime from OS MiB | goroutines |\n")
	fmt.Printf("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|\n")
	for _, pw := range pws {
		if err := measure(ctx, log, *nodes, pw, *idle, *warmCycles, *cycles, soak); err != nil {
			fmt.Fprintln(os.Stderr, "membench:", err)
			return 1
		}
	}
	return 0
}

// soakOpts: how the idle periods are sampled.
type soakOpts struct {
	every  time.Duration // 0: no series
	csv    *os.File      // nil: no CSV
	warmup int           // samples left out of the figures
}

func measure(ctx context.Context, log *slog.Logger, nodes int, password bool, idle time.Duration, warmCycles, cycles int, soak soakOpts) error {
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
		if soak.every > 0 {
			if err := soakSeries(ctx, c.Nodes, pw, what, idle, soak); err != nil {
				return err
			}
		} else {
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(idle):
			}
		}
		for _, n := range c.Nodes {
			m, err := readMem(ctx, n)
			if err != nil {
				return fmt.Errorf("%s: %w", n.Name, err)
			}
			fmt.Printf("| %s | %s | %s | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %d |\n", pw, what, n.Name,
				mib(m.rss), mib(m.hwm), mib(m.anon), mib(m.file), mib(m.heapLive), mib(m.heapInuse), mib(m.sys-m.released), m.goroutines)
		}
		return nil
	}
	cl := api.NewClient(c.Nodes[0].Socket)
	next := 0
	run := func(cycles int) error {
		start := time.Now()
		for range cycles {
			att := api.Attachment{ContainerID: fmt.Sprintf("membench-%d", next), IfName: "eth0"}
			next++
			if _, err := cl.Allocate(ctx, api.AllocateRequest{Attachment: att, PodNamespace: "default", PodName: att.ContainerID}); err != nil {
				return fmt.Errorf("cycle %d: allocate: %w", next, err)
			}
			if _, err := cl.Release(ctx, att); err != nil {
				return fmt.Errorf("cycle %d: release: %w", next, err)
			}
		}
		fmt.Fprintf(os.Stderr, "membench: %d ADD/DEL cycles in %s\n", cycles, time.Since(start).Round(time.Millisecond))
		return nil
	}
	first := "idle"
	if warmCycles > 0 {
		if err := run(warmCycles); err != nil {
			return err
		}
		first = fmt.Sprintf("after %d warm-up ADD/DEL", warmCycles)
	}
	if err := read(first); err != nil {
		return err
	}
	if cycles == 0 {
		return nil
	}
	if err := run(cycles); err != nil {
		return err
	}
	return read(fmt.Sprintf("after %d more ADD/DEL", cycles))
}

type mem struct {
	rss, hwm, anon, file               float64 // bytes
	heapLive, heapInuse, sys, released float64 // bytes, from /metrics
	goroutines                         int
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
	for _, k := range []string{"go_gc_heap_live_bytes", "go_memstats_heap_inuse_bytes", "go_memstats_sys_bytes", "go_memstats_heap_released_bytes", "go_goroutines"} {
		if _, ok := got[k]; !ok {
			return m, errors.New("/metrics has no " + k)
		}
	}
	m.heapInuse, m.sys, m.released = got["go_memstats_heap_inuse_bytes"], got["go_memstats_sys_bytes"], got["go_memstats_heap_released_bytes"]
	m.heapLive = got["go_gc_heap_live_bytes"]
	m.goroutines = int(got["go_goroutines"])
	return m, nil
}

// soakSeries reads every router every soak.every for idle (the first
// reading at once) and prints each router's figures over the period.
func soakSeries(ctx context.Context, nodes []*nscluster.Node, pw, what string, idle time.Duration, soak soakOpts) error {
	type point struct {
		t float64 // seconds since the start
		m mem
	}
	series := make([][]point, len(nodes))
	start := time.Now()
	tick := time.NewTicker(soak.every)
	defer tick.Stop()
	for {
		el := time.Since(start)
		for i, n := range nodes {
			m, err := readMem(ctx, n)
			if err != nil {
				return fmt.Errorf("%s: %w", n.Name, err)
			}
			series[i] = append(series[i], point{el.Seconds(), m})
			if soak.csv != nil {
				fmt.Fprintf(soak.csv, "%s,%s,%s,%.0f,%.0f,%.0f,%.0f,%.0f,%.0f,%.0f,%d\n", pw, what, n.Name, el.Seconds(),
					m.rss, m.anon, m.file, m.heapLive, m.heapInuse, m.sys-m.released, m.goroutines)
			}
		}
		fmt.Fprintf(os.Stderr, "membench: password %s: %s: sample at %s: %s VmRSS %.1f MiB, heap %.1f MiB, %d goroutines\n",
			pw, what, el.Round(time.Second), nodes[0].Name, mib(series[0][len(series[0])-1].m.rss),
			mib(series[0][len(series[0])-1].m.heapInuse), series[0][len(series[0])-1].m.goroutines)
		if el >= idle {
			break
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-tick.C:
		}
	}
	fmt.Printf("\nSoak, password %s, %s, %d samples every %s over %s (figures leave out the first %d):\n\n", pw, what,
		len(series[0]), soak.every, time.Since(start).Round(time.Second), soak.warmup)
	fmt.Printf("| router | figure | start | end | min | max | (max−min)/start | slope per hour |\n|---|---|---:|---:|---:|---:|---:|---:|\n")
	for i, n := range nodes {
		ps := series[i]
		if soak.warmup < len(ps) {
			ps = ps[soak.warmup:]
		}
		for _, f := range []struct {
			name string
			unit float64
			get  func(mem) float64
		}{
			{"VmRSS MiB", 1 << 20, func(m mem) float64 { return m.rss }},
			{"Go heap live MiB", 1 << 20, func(m mem) float64 { return m.heapLive }},
			{"Go heap in use MiB", 1 << 20, func(m mem) float64 { return m.heapInuse }},
			{"Go runtime from OS MiB", 1 << 20, func(m mem) float64 { return m.sys - m.released }},
			{"goroutines", 1, func(m mem) float64 { return float64(m.goroutines) }},
		} {
			xs, ys := make([]float64, len(ps)), make([]float64, len(ps))
			lo, hi := f.get(ps[0].m), f.get(ps[0].m)
			for j, p := range ps {
				xs[j], ys[j] = p.t, f.get(p.m)
				lo, hi = min(lo, ys[j]), max(hi, ys[j])
			}
			first, last := ys[0], ys[len(ys)-1]
			fmt.Printf("| %s | %s | %.1f | %.1f | %.1f | %.1f | %.1f %% | %+.2f |\n", n.Name, f.name,
				first/f.unit, last/f.unit, lo/f.unit, hi/f.unit, 100*(hi-lo)/first, slope(xs, ys)*3600/f.unit)
		}
	}
	fmt.Println()
	return nil
}

// slope is the least-squares slope of ys over xs (0 for fewer than two points).
func slope(xs, ys []float64) float64 {
	n := float64(len(xs))
	if n < 2 {
		return 0
	}
	var sx, sy, sxx, sxy float64
	for i := range xs {
		sx += xs[i]
		sy += ys[i]
		sxx += xs[i] * xs[i]
		sxy += xs[i] * ys[i]
	}
	d := n*sxx - sx*sx
	if d == 0 {
		return 0
	}
	return (n*sxy - sx*sy) / d
}
