// Command cnibench measures the latency of CNI ADD and DEL as a container
// runtime sees it: libcni in-process, the plugins run inside a node's network
// namespace (the e2e package's runtime). It adds -n pods one after another,
// then deletes them one after another, and prints a markdown table row per
// configuration with the mean, median and 99th percentile. With -c, the
// pods are added (and then deleted) in waves of c started at once, as on a
// node that starts many pods together; for weft it then also prints the
// router's own figure for the allocations: the latency of the local API's
// allocate requests (from the accept of the plugin's connection to the
// answer), from the router's weft_local_api_request_duration_seconds.
//
//	cnibench            # both configurations, side by side
//	cnibench -ref       # the reference bridge + host-local plugins only
//	cnibench -weft      # a weft router's conflist only (needs `make build`)
//	cnibench -c 20      # waves of 20 ADDs at once, then of 20 DELs
//
// Needs root. Everything it makes lives in namespaces of its own and is
// removed on exit, also on SIGINT and SIGTERM.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net/netip"
	"os"
	"os/signal"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/weft-net/weft/e2e"
	"github.com/weft-net/weft/router"
)

func main() { os.Exit(run()) }

func run() int {
	n := flag.Int("n", 100, "pods per configuration, added then deleted one after another")
	conc := flag.Int("c", 1, "CNI calls started at once: pods are added, then deleted, in waves of c, each wave when the one before has ended")
	ref := flag.Bool("ref", false, "measure the reference bridge + host-local conflist")
	weft := flag.Bool("weft", false, "measure the conflist a weft router writes")
	refBin := flag.String("ref-bin", e2e.RefPluginDir, "directory of the reference CNI plugins")
	binDir := flag.String("bin", "", "directory of the weft binaries (default $WEFT_BIN_DIR, else bin/ of the weft module)")
	routerArgs := flag.String("router-args", "", "extra arguments for `weft router`, separated by spaces")
	verbose := flag.Bool("v", false, "log what the harness does on stderr")
	flag.Parse()
	if flag.NArg() > 0 {
		fmt.Fprintf(os.Stderr, "cnibench: unexpected arguments %q\n", flag.Args())
		return 2
	}
	if *n < 1 || *n > 5000 {
		fmt.Fprintf(os.Stderr, "cnibench: -n is %d; give 1 to 5000 pods\n", *n)
		return 2
	}
	if *conc < 1 || *conc > *n {
		fmt.Fprintf(os.Stderr, "cnibench: -c is %d; give 1 to -n (%d) calls at once\n", *conc, *n)
		return 2
	}
	if !*ref && !*weft {
		*ref, *weft = true, true
	}
	if os.Geteuid() != 0 {
		fmt.Fprintln(os.Stderr, "cnibench: needs root to make network namespaces")
		return 2
	}

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop() // after Close, so that a second signal cannot cut Close short
	var logw io.Writer = io.Discard
	if *verbose {
		logw = os.Stderr
	}
	log := slog.New(slog.NewTextHandler(logw, &slog.HandlerOptions{Level: slog.LevelDebug}))

	r, err := e2e.NewRun(e2e.Options{Log: log, BinDir: *binDir})
	if err != nil {
		fmt.Fprintln(os.Stderr, "cnibench:", err)
		return 1
	}
	defer func() {
		if err := r.Close(); err != nil {
			fmt.Fprintln(os.Stderr, "cnibench:", err)
		}
	}()
	c, err := r.NewCluster(ctx, e2e.ClusterOpts{})
	if err != nil {
		fmt.Fprintln(os.Stderr, "cnibench:", err)
		return 1
	}

	fmt.Println("| conflist | pods | at once | ADD mean | ADD p50 | ADD p99 | DEL mean | DEL p50 | DEL p99 |")
	fmt.Println("|---|---|---|---|---|---|---|---|---|")
	failed := false
	var allocRows []string // the router's figures, a table of their own after this one
	bench := func(label, podPrefix string, node *e2e.Node, err error) {
		var before allocHist
		if err == nil && node.Router() != nil {
			before, err = allocations(ctx, node)
		}
		if err == nil && ctx.Err() == nil {
			err = measure(ctx, node, label, podPrefix, *n, *conc)
		}
		if err == nil && node.Router() != nil {
			var after allocHist
			after, err = allocations(ctx, node)
			if err == nil {
				allocRows = append(allocRows, after.since(before).row(label, *conc))
			}
		}
		if err != nil {
			fmt.Fprintf(os.Stderr, "cnibench: %s: %v\n", label, err)
			failed = true
		}
	}
	// Pairs of like with like, each pair measured back to back: the plugin
	// alone, then the whole chain ending in portmap (the same portmap binary,
	// nftables backend, for both).
	if *ref {
		node, err := refNode(ctx, c, *refBin)
		if err == nil {
			err = node.UseRefConfList(refSubnet, false)
		}
		bench("reference bridge + host-local", "r", node, err)
		if err == nil {
			err = node.UseRefConfList(refSubnet, true)
		}
		bench("reference bridge + host-local + portmap", "rp", node, err)
	}
	if *weft {
		node, err := weftNode(ctx, c, strings.Fields(*routerArgs))
		var conf []byte
		if err == nil {
			conf, err = os.ReadFile(filepath.Join(node.CNIConfDir, router.ConfListName))
		}
		if err == nil {
			err = node.WriteConfList(router.ConfListName, weftOnly(node.Socket))
		}
		bench("weft-cni", "w", node, err)
		if err == nil {
			err = node.WriteConfList(router.ConfListName, conf)
		}
		bench("weft-cni + portmap (the conflist weft writes)", "wp", node, err)
	}
	if len(allocRows) > 0 {
		fmt.Println()
		fmt.Println("| the router's allocations (local API, accept to answer), conflist | allocations | ADDs at once | p50 | p99 | max bucket | at most 5 ms |")
		fmt.Println("|---|---|---|---|---|---|---|")
		for _, row := range allocRows {
			fmt.Println(row)
		}
	}
	if failed || ctx.Err() != nil {
		return 1
	}
	return 0
}

// refNode is a node with the reference conflist.
func refNode(ctx context.Context, c *e2e.Cluster, pluginDir string) (*e2e.Node, error) {
	node, err := c.AddNode(ctx, "ref")
	if err != nil {
		return nil, err
	}
	// weft's bin dir first, so that both chains run the same portmap.
	bin, err := c.Run.BinDir()
	if err != nil {
		return nil, err
	}
	node.CNIPath = append(node.CNIPath, bin, pluginDir)
	return node, nil
}

var refSubnet = netip.MustParsePrefix("10.88.0.0/16")

// weftOnly is a conflist with weft-cni alone.
func weftOnly(socket string) []byte {
	return []byte(fmt.Sprintf(`{"cniVersion":"1.0.0","name":"weft","plugins":[{"type":"weft-cni","socket":%q}]}`, socket))
}

// weftNode is a node with a ready weft router and the conflist it wrote.
func weftNode(ctx context.Context, c *e2e.Cluster, routerArgs []string) (*e2e.Node, error) {
	node, err := c.AddNode(ctx, "weft")
	if err != nil {
		return nil, err
	}
	if _, err := node.StartRouter(routerArgs...); err != nil {
		return nil, err
	}
	if err := node.WaitReady(ctx); err != nil {
		return nil, err
	}
	return node, nil
}

// measure adds n pods on node, then deletes them, c CNI calls at once
// (waves of c released together, each when the one before has ended),
// timing each call (making the pods' namespaces is not timed), and prints
// a row.
func measure(ctx context.Context, node *e2e.Node, label, podPrefix string, n, c int) error {
	pods := make([]*e2e.Pod, 0, n)
	for i := range n {
		p, err := node.NewPod(ctx, fmt.Sprintf("%s%d", podPrefix, i))
		if err != nil {
			return err
		}
		pods = append(pods, p)
	}
	add, err := waves(pods, c, func(p *e2e.Pod) error { return node.Attach(ctx, p) })
	if err != nil {
		return err
	}
	del, err := waves(pods, c, func(p *e2e.Pod) error { return node.DelPod(ctx, p) })
	if err != nil {
		return err
	}
	a, d := summarize(add), summarize(del)
	fmt.Printf("| %s | %d | %d | %s | %s | %s | %s | %s | %s |\n", label, n, c, ms(a.mean), ms(a.p50), ms(a.p99), ms(d.mean), ms(d.p50), ms(d.p99))
	return nil
}

// waves runs call for every pod, c at once: each wave's calls wait on one
// gate and are released together; the next wave starts when the last call
// of this one has returned. It returns each call's duration, and the
// errors of all calls.
func waves(pods []*e2e.Pod, c int, call func(*e2e.Pod) error) ([]time.Duration, error) {
	took := make([]time.Duration, len(pods))
	errs := make([]error, len(pods))
	for first := 0; first < len(pods); first += c {
		wave := pods[first:min(first+c, len(pods))]
		gate := make(chan struct{})
		var ready, wg sync.WaitGroup
		ready.Add(len(wave))
		for i, p := range wave {
			wg.Go(func() {
				ready.Done()
				<-gate
				start := time.Now()
				errs[first+i] = call(p)
				took[first+i] = time.Since(start)
			})
		}
		ready.Wait()
		close(gate)
		wg.Wait()
		if err := errors.Join(errs[first : first+len(wave)]...); err != nil {
			return nil, err
		}
	}
	return took, nil
}

type summary struct{ mean, p50, p99 time.Duration }

// summarize computes the mean and the nearest-rank percentiles.
func summarize(ds []time.Duration) summary {
	s := slices.Clone(ds)
	slices.Sort(s)
	var sum time.Duration
	for _, d := range s {
		sum += d
	}
	rank := func(p float64) time.Duration {
		i := int(math.Ceil(p*float64(len(s)))) - 1
		return s[max(0, min(i, len(s)-1))]
	}
	return summary{mean: sum / time.Duration(len(s)), p50: rank(0.50), p99: rank(0.99)}
}

func ms(d time.Duration) string { return fmt.Sprintf("%.2f ms", float64(d)/float64(time.Millisecond)) }
