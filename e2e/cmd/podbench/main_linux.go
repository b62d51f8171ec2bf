// Command podbench measures pod-to-pod TCP throughput through the real
// product: for each -modes, a two-node cluster of network namespaces (the
// e2e harness), a `weft router` process in each node with --encap MODE,
// one pod per node attached by the weft-cni plugin, and iperf3 from the pod
// on node a to the pod on node b. Side by side in the same run: the raw
// underlay (node to node) and a plain kernel VXLAN between the two node
// namespaces, and (-library, on by default) a control: each mode's
// tunnel library (tunnel.Device) running in this process on the same
// underlay, without router, bridge, CNI or nftables, as tunnelbench runs
// it. Every path is built first, then measured round by round so
// that the machine's other load falls on all alike; each row is the median
// of -runs. The forwarders' CPU time (both router processes, from
// /proc/<pid>/stat; this process for the control) is reported in cores and
// per Gbit/s.
//
// It prints a Markdown table for docs/benchmarks.md on stdout and its
// progress on stderr. Needs root and `make build` (the harness runs the
// binaries in bin/). Everything it makes lives in namespaces of its own and
// is removed on exit, also on SIGINT and SIGTERM.
//
// -pod-baselines (on by default) adds pods without weft over the same kernel
// VXLAN, in a cluster of their own without routers: the reference bridge
// plugin, and a routed veth without a bridge (podbase_linux.go).
//
// For vxlan, and auto where it picks vxlan (two nodes without a
// password), the routers forward nothing (the kernel's weft-vx does): the
// row has no forwarder CPU, and no library control.
//
//	go run ./e2e/cmd/podbench [-modes udp,ipip,vxlan,auto] [-runs 3] [-time 6s] [-streams 1,4]
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net/netip"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/weft-net/weft/e2e"
	"github.com/weft-net/weft/tunnel"
)

func main() { os.Exit(run()) }

func run() int {
	dur := flag.Duration("time", 6*time.Second, "length of each iperf3 run (whole seconds, at least 2s; the first second is omitted)")
	streams := flag.String("streams", "1,4", "parallel TCP streams (iperf3 -P), comma-separated")
	modes := flag.String("modes", "udp,ipip,vxlan,auto", "weft --encap modes to measure, comma-separated (udp, ipip, vxlan, auto)")
	runs := flag.Int("runs", 3, "rounds over every path; each row is the median")
	binDir := flag.String("bin", "", "directory of the weft binaries (default $WEFT_BIN_DIR, else bin/ of the weft module)")
	routerArgs := flag.String("router-args", "", "extra arguments for every `weft router`, separated by spaces (e.g. \"--mtu 1400\")")
	verbose := flag.Bool("v", false, "log what the harness does on stderr")
	keep := flag.Bool("keep", false, "after the table, keep every path up until Ctrl-C, for poking around")
	library := flag.Bool("library", true, "measure each mode's tunnel library in this process on the same underlay too, as a control")
	podBase := flag.Bool("pod-baselines", true, "measure pods without weft over the same kernel VXLAN too: the reference bridge plugin, and a routed veth")
	flag.Parse()

	cfg, err := parseFlags(*dur, *streams, *modes, *runs)
	if err == nil && flag.NArg() > 0 {
		err = fmt.Errorf("unexpected arguments %q", flag.Args())
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "podbench:", err)
		return 2
	}
	if os.Geteuid() != 0 {
		fmt.Fprintln(os.Stderr, "podbench: run as root (it makes network namespaces and starts routers in them)")
		return 2
	}
	cfg.binDir, cfg.routerArgs, cfg.keep, cfg.library, cfg.podBase = *binDir, strings.Fields(*routerArgs), *keep, *library, *podBase

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop() // after the runs' Close: a second Ctrl-C cannot cut it short
	var logw io.Writer = io.Discard
	if *verbose {
		logw = os.Stderr
	}
	b := &bench{cfg: cfg, ctx: ctx, log: slog.New(slog.NewTextHandler(logw, &slog.HandlerOptions{Level: slog.LevelDebug}))}
	err = b.run()
	if cerr := b.close(); cerr != nil {
		fmt.Fprintln(os.Stderr, "podbench:", cerr)
		if err == nil {
			return 1
		}
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "podbench:", err)
		return 1
	}
	return 0
}

// The kernel VXLAN baseline between the two nodes of the first cluster. Its
// subnet, device and port are apart from weft's: the underlay is
// 10.250.0.0/24, pods are in 10.32.0.0/12, weft's devices are "weft" and
// "weft-tun" (and "weft-ipip"), and its data port is 6784.
var vxlanSubnet = netip.MustParsePrefix("10.251.0.0/24")

const (
	vxlanDev  = "benchvx"
	vxlanID   = "42"
	vxlanPort = 4789
	iperfPort = 5201
)

type bench struct {
	cfg  config
	ctx  context.Context
	log  *slog.Logger
	runs []*e2e.Run // one per cluster (a run holds one): routers of each mode, each control
}

// path is one way from a client to a server that the bench measures.
type path struct {
	name           string
	run            *e2e.Run // where the iperf3 server is started
	client, server *e2e.Netns
	addr           netip.Addr
	routers        []int // pids of the routers on the path; none for kernel paths
	self           bool  // the tunnel runs in this process: count its CPU
}

// forwarded reports whether the path has a userspace forwarder whose CPU
// is reported.
func (p path) forwarded() bool { return len(p.routers) > 0 || p.self }

// cpu is the CPU time the path's forwarders have used so far.
func (p path) cpu() (time.Duration, error) {
	if p.self {
		return selfCPU(), nil
	}
	return cpuTime(p.routers)
}

// close closes every run, the last made first.
func (b *bench) close() error {
	var errs []error
	for i := len(b.runs) - 1; i >= 0; i-- {
		errs = append(errs, b.runs[i].Close())
	}
	return errors.Join(errs...)
}

func progress(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "podbench: "+format+"\n", args...)
}

// run builds every path, then measures them round by round and prints the
// table.
func (b *bench) run() error {
	start := time.Now()
	load0 := loadavg()
	var weft []path
	var base []path
	for _, m := range b.cfg.modes {
		c, p, err := b.cluster(m)
		if err != nil {
			return fmt.Errorf("%s cluster: %w", m, err)
		}
		weft = append(weft, p)
		if b.cfg.library && !hasVXLAN(m) {
			lp, err := b.library(m)
			if err != nil {
				return fmt.Errorf("%s control path: %w", m, err)
			}
			weft = append(weft, lp)
		}
		if base == nil && !hasVXLAN(m) {
			// The baselines run between the nodes of the first cluster
			// without weft's own VXLAN device (both would take port 4789),
			// next to its routers, under the same nftables rules as weft's
			// path.
			if base, err = b.baselines(c); err != nil {
				return fmt.Errorf("baselines: %w", err)
			}
		}
	}
	if b.cfg.podBase {
		pb, err := b.podBaselines()
		if err != nil {
			return fmt.Errorf("pod baselines: %w", err)
		}
		base = append(base, pb...)
	}
	paths := append(base, weft...)
	progress("built %d paths in %s; measuring %d rounds of %s per path and stream count", len(paths), time.Since(start).Round(time.Second), b.cfg.runs, b.cfg.dur)

	type key struct{ path, streams int }
	res := map[key][]result{}
	for r := range b.cfg.runs {
		for pi, p := range paths {
			for _, s := range b.cfg.streams {
				m, err := b.measure(p, s)
				if err != nil {
					return err
				}
				cpu := "kernel"
				if p.forwarded() {
					cpu = fmt.Sprintf("%.2f cores", m.cpu)
				}
				progress("run %d: %-62s P=%d %6.2f Gbit/s  forwarder CPU %s  retransmits %d  load %.1f", r+1, p.name, s, m.gbps, cpu, m.retrans, m.load)
				res[key{pi, s}] = append(res[key{pi, s}], m)
			}
		}
	}
	var rows []row
	for pi, p := range paths {
		for _, s := range b.cfg.streams {
			rows = append(rows, summarize(p.name, p.forwarded(), s, res[key{pi, s}]))
		}
	}
	printTable(os.Stdout, rows, tableInfo{
		took: time.Since(start), runs: b.cfg.runs, dur: b.cfg.dur,
		load0: load0, load1: loadavg(), routerArgs: b.cfg.routerArgs,
	})
	if b.cfg.keep && b.ctx.Err() == nil {
		progress("staying up until Ctrl-C; each path's client and server namespace (`ip netns exec NAME ...`):")
		for _, p := range paths {
			progress("  %s: %s -> %s (%s)", p.name, p.client, p.server, p.addr)
		}
		<-b.ctx.Done()
	}
	return nil
}

// cluster builds a two-node cluster whose routers use mode, attaches one
// pod per node through CNI and returns the cluster and the pod-to-pod path.
func (b *bench) cluster(mode tunnel.Mode) (*e2e.Cluster, path, error) {
	ctx, cancel := context.WithTimeout(b.ctx, 3*time.Minute)
	defer cancel()
	r, err := e2e.NewRun(e2e.Options{Log: b.log, BinDir: b.cfg.binDir})
	if err != nil {
		return nil, path{}, err
	}
	b.runs = append(b.runs, r)
	c, err := r.NewCluster(ctx, e2e.ClusterOpts{Nodes: 2})
	if err != nil {
		return nil, path{}, err
	}
	peers := c.Nodes[0].UnderlayIP.String() + "," + c.Nodes[1].UnderlayIP.String()
	args := append([]string{"--peers", peers, "--encap", string(mode)}, b.cfg.routerArgs...)
	progress("%s: 2 nodes in namespaces %s-*; starting weft router %s", mode, r.Prefix(), strings.Join(args, " "))
	var pids []int
	for _, n := range c.Nodes {
		rt, err := n.StartRouter(args...)
		if err != nil {
			return nil, path{}, err
		}
		pids = append(pids, rt.Proc().Pid())
	}
	for _, n := range c.Nodes {
		if err := n.WaitReady(ctx); err != nil {
			return nil, path{}, err
		}
	}
	picked, kernel, err := waitMode(ctx, c, mode)
	if err != nil {
		return nil, path{}, err
	}
	a, err := c.Nodes[0].AddPod(ctx, "a")
	if err != nil {
		return nil, path{}, err
	}
	pb, err := c.Nodes[1].AddPod(ctx, "b")
	if err != nil {
		return nil, path{}, err
	}
	if err := e2e.Ping(ctx, a.NS, pb.IP); err != nil {
		return nil, path{}, fmt.Errorf("pod %s cannot reach pod %s before the benchmark: %w\n%s", a, pb, err, routerLogs(c))
	}
	name := "weft " + string(mode)
	if mode == tunnel.ModeAuto {
		name += ", picked " + string(picked)
	}
	if picked == tunnel.ModeIPIP {
		name += map[bool]string{true: " (kernel IPIP)", false: " (userspace IPIP: TUN + raw socket)"}[kernel]
	}
	progress("%s: routers ready, sending to each other with %s; pods %s (%s) and %s (%s); %s", mode, name, a, a.Prefix, pb, pb.Prefix, describe(a, c.Nodes[0], pids[0]))
	if picked == tunnel.ModeVXLAN {
		name += " (kernel VXLAN weft-vx)"
		pids = nil // the kernel forwards: the routers' CPU is not the path's
	}
	return c, path{name: name + " (pod to pod, through the routers)", run: r, client: a.NS, server: pb.NS, addr: pb.IP, routers: pids}, nil
}

// connReport is the part of a router's /report about data paths.
type connReport struct {
	Router struct {
		Connections []struct {
			Peer   string `json:"peer"`
			Mode   string `json:"mode"`
			Kernel bool   `json:"kernel"`
		} `json:"connections"`
	} `json:"router"`
}

// waitMode polls both routers' /report until each sends to the other with
// mode (with auto: the same mode both ways, whichever it picked), and
// returns the mode and whether that is the kernel's device.
func waitMode(ctx context.Context, c *e2e.Cluster, mode tunnel.Mode) (picked tunnel.Mode, kernel bool, err error) {
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	t := time.NewTicker(100 * time.Millisecond)
	defer t.Stop()
	var seen []string
	for {
		seen = seen[:0]
		ok := true
		for i, n := range c.Nodes {
			other := c.Nodes[1-i]
			var rep connReport
			data, err := n.HTTPGet(ctx, "/report")
			if err == nil {
				err = json.Unmarshal(data, &rep)
			}
			got := ""
			for _, cn := range rep.Router.Connections {
				if cn.Peer == other.PeerName {
					got, kernel = cn.Mode, cn.Kernel
				}
			}
			seen = append(seen, fmt.Sprintf("%s->%s: %q (%v)", n.Name, other.Name, got, err))
			switch {
			case mode == tunnel.ModeAuto && i == 0:
				picked = tunnel.Mode(got)
				ok = ok && got != ""
			case mode == tunnel.ModeAuto:
				ok = ok && got == string(picked)
			default:
				picked = mode
				ok = ok && got == string(mode)
			}
		}
		if ok {
			return picked, kernel, nil
		}
		select {
		case <-ctx.Done():
			return "", false, fmt.Errorf("routers not sending to each other with %s: %w; last seen %s\n%s", mode, ctx.Err(), strings.Join(seen, ", "), routerLogs(c))
		case <-t.C:
		}
	}
}

func routerLogs(c *e2e.Cluster) string {
	var sb strings.Builder
	for _, n := range c.Nodes {
		if r := n.Router(); r != nil {
			fmt.Fprintf(&sb, "--- %s router log (tail):\n%s\n", n.Name, r.LogTail(30))
		}
	}
	return sb.String()
}

// describe says what MTUs the pod and the node's TUN device have and how
// many queues of it the router holds, for the reader of the progress lines.
func describe(p *e2e.Pod, n *e2e.Node, routerPid int) string {
	var parts []string
	_ = p.NS.WithHandle(func(h *netlink.Handle) error {
		if l, err := h.LinkByName(p.IfName); err == nil {
			parts = append(parts, fmt.Sprintf("pod MTU %d", l.Attrs().MTU))
		}
		return nil
	})
	_ = n.NS.WithHandle(func(h *netlink.Handle) error {
		if l, err := h.LinkByName(tunnel.DefaultTUNName); err == nil {
			a := l.Attrs()
			parts = append(parts, fmt.Sprintf("%s MTU %d, GSO max %d, %d queues open in the router", a.Name, a.MTU, a.GSOMaxSize, tunQueues(routerPid, a.Name)))
		}
		return nil
	})
	return strings.Join(parts, "; ")
}

// tunQueues counts the router's open descriptors attached to the TUN
// device dev (one per queue): their /proc fdinfo says "iff: dev".
func tunQueues(pid int, dev string) int {
	dir := fmt.Sprintf("/proc/%d/fdinfo", pid)
	entries, err := os.ReadDir(dir)
	if err != nil {
		return -1
	}
	n := 0
	for _, e := range entries {
		data, err := os.ReadFile(filepath.Join(dir, e.Name()))
		if err != nil {
			continue
		}
		for _, l := range strings.Split(string(data), "\n") {
			if f := strings.Fields(l); len(f) == 2 && f[0] == "iff:" && f[1] == dev {
				n++
			}
		}
	}
	return n
}

// baselines adds a kernel VXLAN between the two nodes of c and returns the
// underlay and VXLAN paths, node a to node b.
func (b *bench) baselines(c *e2e.Cluster) ([]path, error) {
	ctx, cancel := context.WithTimeout(b.ctx, time.Minute)
	defer cancel()
	vx, err := addBenchVXLAN(ctx, c)
	if err != nil {
		return nil, err
	}
	a, bn := c.Nodes[0], c.Nodes[1]
	progress("baselines: underlay %s -> %s (veth, bridge, veth), kernel VXLAN %s -> %s (id %s, port %d, over eth0)", a.UnderlayIP, bn.UnderlayIP, vx[0], vx[1], vxlanID, vxlanPort)
	return []path{
		{name: underlayRow, run: c.Run, client: a.NS, server: bn.NS, addr: bn.UnderlayIP},
		{name: vxlanRow, run: c.Run, client: a.NS, server: bn.NS, addr: vx[1]},
	}, nil
}

// vxlanFree checks that the VXLAN's device name, subnet and port are not
// in use on node n (by weft or anything else).
func vxlanFree(ctx context.Context, n *e2e.Node) error {
	err := n.NS.WithHandle(func(h *netlink.Handle) error {
		if _, err := h.LinkByName(vxlanDev); err == nil {
			return fmt.Errorf("node %s has a link %s already", n.Name, vxlanDev)
		}
		routes, err := h.RouteList(nil, netlink.FAMILY_V4)
		if err != nil {
			return err
		}
		for _, r := range routes {
			if r.Dst == nil {
				continue
			}
			ones, _ := r.Dst.Mask.Size()
			dst, ok := netip.AddrFromSlice(r.Dst.IP)
			if ok && ones > 0 && netip.PrefixFrom(dst.Unmap(), ones).Overlaps(vxlanSubnet) {
				return fmt.Errorf("node %s routes %s already, which overlaps the VXLAN baseline's %s", n.Name, r.Dst, vxlanSubnet)
			}
		}
		return nil
	})
	if err != nil {
		return err
	}
	out, err := n.NS.Exec(ctx, "ss", "-Hlun", "sport", "= :"+strconv.Itoa(vxlanPort))
	if err != nil {
		return err
	}
	if len(bytes.TrimSpace(out)) > 0 {
		return fmt.Errorf("node %s has UDP port %d in use already: %s", n.Name, vxlanPort, bytes.TrimSpace(out))
	}
	return nil
}

// measure runs iperf3 over p with the given streams and returns the
// received rate, the routers' CPU use meanwhile and the retransmits.
func (b *bench) measure(p path, streams int) (result, error) {
	srv, err := p.run.Start(p.server, "iperf3 server", filepath.Join(p.run.Dir(), "iperf3-server.log"),
		"iperf3", "-s", "-1", "-B", p.addr.String(), "-p", strconv.Itoa(iperfPort))
	if err != nil {
		return result{}, err
	}
	defer func() { _ = srv.Kill() }()
	if err := waitListening(b.ctx, p.server, iperfPort, srv); err != nil {
		return result{}, err
	}
	before, err := p.cpu()
	if err != nil {
		return result{}, err
	}
	t0 := time.Now()
	out, err := output(b.ctx, p.client, "iperf3", "-c", p.addr.String(), "-p", strconv.Itoa(iperfPort),
		"-t", strconv.Itoa(int(b.cfg.dur/time.Second)), "-O", "1", "-P", strconv.Itoa(streams), "-J")
	wall := time.Since(t0)
	after, cerr := p.cpu()
	var rep struct {
		Error string `json:"error"`
		End   struct {
			SumSent struct {
				Retransmits int `json:"retransmits"`
			} `json:"sum_sent"`
			SumReceived struct {
				BitsPerSecond float64 `json:"bits_per_second"`
			} `json:"sum_received"`
		} `json:"end"`
	}
	jerr := json.Unmarshal(out, &rep)
	switch {
	case err != nil && rep.Error != "":
		return result{}, fmt.Errorf("%s, %d streams: iperf3: %s (%w)", p.name, streams, rep.Error, err)
	case err != nil:
		return result{}, fmt.Errorf("%s, %d streams: %w", p.name, streams, err)
	case jerr != nil:
		return result{}, fmt.Errorf("%s, %d streams: iperf3's JSON output: %w: %.300s", p.name, streams, jerr, out)
	case cerr != nil:
		return result{}, cerr
	case rep.End.SumReceived.BitsPerSecond <= 0:
		return result{}, fmt.Errorf("%s, %d streams: iperf3 reported no data received: %.300s", p.name, streams, out)
	}
	return result{
		gbps:    rep.End.SumReceived.BitsPerSecond / 1e9,
		cpu:     (after - before).Seconds() / wall.Seconds(),
		retrans: rep.End.SumSent.Retransmits,
		load:    loadavg(),
	}, nil
}

// output runs argv inside ns and returns its standard output; a failure
// carries its standard error. Cancelling ctx kills the command.
func output(ctx context.Context, ns *e2e.Netns, argv ...string) ([]byte, error) {
	var stdout, stderr bytes.Buffer
	var runErr error
	if err := ns.Do(func() error {
		cmd := exec.CommandContext(ctx, argv[0], argv[1:]...)
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		runErr = cmd.Run()
		return nil
	}); err != nil {
		return nil, fmt.Errorf("entering netns %s: %w", ns.Name, err)
	}
	if runErr != nil {
		return stdout.Bytes(), fmt.Errorf("%s in netns %s: %w: %s", strings.Join(argv, " "), ns.Name, runErr, bytes.TrimSpace(stderr.Bytes()))
	}
	return stdout.Bytes(), nil
}

// waitListening polls until something listens on TCP port in ns, the
// server exits, or 10s pass.
func waitListening(ctx context.Context, ns *e2e.Netns, port int, srv *e2e.Proc) error {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	t := time.NewTicker(20 * time.Millisecond)
	defer t.Stop()
	for {
		out, err := ns.Exec(ctx, "ss", "-Hltn", "sport", "= :"+strconv.Itoa(port))
		if err == nil && len(bytes.TrimSpace(out)) > 0 {
			return nil
		}
		select {
		case <-srv.Exited():
			return fmt.Errorf("iperf3 server in %s exited before it listened (%v); see %s", ns.Name, srv.Wait(), srv.LogPath)
		case <-ctx.Done():
			return fmt.Errorf("iperf3 server in %s not listening on port %d: %w", ns.Name, port, ctx.Err())
		case <-t.C:
		}
	}
}

// clockTick is USER_HZ, the unit of utime and stime in /proc/<pid>/stat:
// 100 on every Linux architecture weft runs on.
const clockTick = 100

// cpuTime is the user and system CPU time the processes have used so far
// (all their threads).
func cpuTime(pids []int) (time.Duration, error) {
	var ticks uint64
	for _, pid := range pids {
		data, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if err != nil {
			return 0, fmt.Errorf("router pid %d gone? %w", pid, err)
		}
		t, err := parseStatTicks(data)
		if err != nil {
			return 0, fmt.Errorf("/proc/%d/stat: %w", pid, err)
		}
		ticks += t
	}
	return time.Duration(ticks) * time.Second / clockTick, nil
}

// loadavg is the machine's 1-minute load average, or -1 if unreadable.
func loadavg() float64 {
	data, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return -1
	}
	f := strings.Fields(string(data))
	if len(f) == 0 {
		return -1
	}
	v, err := strconv.ParseFloat(f[0], 64)
	if err != nil {
		return -1
	}
	return v
}
