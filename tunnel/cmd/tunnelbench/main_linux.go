// Command tunnelbench measures the throughput of weft's data plane: TCP
// (iperf3) between two pods on two nodes, each node a network namespace
// with the tunnel running in this process, side by side in the same run
// with the raw veth underlay between the nodes, a plain kernel VXLAN
// between them, and a naive forwarder (one goroutine each way, one packet
// per system call); udp also encrypted (a password set). It prints a
// Markdown table for docs/benchmarks.md.
//
// Run as root: go run ./tunnel/cmd/tunnelbench
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"os/signal"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/weft-net/weft/tunnel"
	"github.com/weft-net/weft/tunnel/crypt"
	"github.com/weft-net/weft/tunnel/internal/netnstest"
	"github.com/weft-net/weft/tunnel/tun"
)

func main() {
	dur := flag.Duration("time", 6*time.Second, "length of each iperf3 run")
	streams := flag.String("streams", "1,4", "parallel TCP streams, comma-separated")
	modes := flag.String("modes", "udp,ipip", "weft modes to measure")
	runs := flag.Int("runs", 3, "rounds over every path; each row is the median")
	naive := flag.Bool("naive", true, "measure the naive forwarder too")
	encrypted := flag.Bool("encrypted", true, "measure udp with encryption (a password set) too")
	verbose := flag.Bool("v", false, "log the tunnel's info messages")
	cpuprofile := flag.String("cpuprofile", "", "write a CPU profile of the whole run to this file")
	flag.Parse()
	if *cpuprofile != "" {
		f, err := os.Create(*cpuprofile)
		if err != nil {
			fmt.Fprintln(os.Stderr, "tunnelbench:", err)
			os.Exit(1)
		}
		if err := pprof.StartCPUProfile(f); err != nil {
			fmt.Fprintln(os.Stderr, "tunnelbench:", err)
			os.Exit(1)
		}
		defer pprof.StopCPUProfile()
	}
	if os.Geteuid() != 0 {
		fmt.Fprintln(os.Stderr, "tunnelbench: run as root (it makes network namespaces)")
		os.Exit(2)
	}
	level := slog.LevelWarn
	if *verbose {
		level = slog.LevelInfo
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))
	var ss []int
	for _, s := range strings.Split(*streams, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(s))
		if err != nil || n < 1 {
			fmt.Fprintf(os.Stderr, "tunnelbench: bad -streams %q\n", *streams)
			os.Exit(2)
		}
		ss = append(ss, n)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	b := &bench{ctx: ctx, dur: *dur, streams: ss, runs: max(*runs, 1), log: log}
	ms := strings.Split(*modes, ",")
	if *encrypted && slices.Contains(ms, "udp") {
		ms = append(ms, encryptedUDP)
	}
	if err := b.run(ms, *naive); err != nil {
		fmt.Fprintln(os.Stderr, "tunnelbench:", err)
		pprof.StopCPUProfile()
		os.Exit(1)
	}
}

// encryptedUDP is the -modes entry of udp with a password set.
const encryptedUDP = "udp-encrypted"

type bench struct {
	ctx     context.Context
	dur     time.Duration
	streams []int
	runs    int
	log     *slog.Logger
	rows    []row
}

// path is one way from a client to a server that the bench measures.
type path struct {
	name           string
	userspace      bool // the forwarder runs in this process
	client, server *netnstest.NS
	addr           netip.Addr
}

type row struct {
	name      string
	streams   int
	gbps      float64 // median over the runs
	cpu       float64 // cores this process used, median over the runs
	userspace bool
	retrans   int // over all runs
}

// run builds every path first, then measures them round by round, so
// that the machine's other load falls on all of them alike; each row is
// the median of its runs.
func (b *bench) run(modes []string, naive bool) error {
	start := time.Now()
	var paths []path
	var cleanups []func()
	defer func() {
		for i := len(cleanups) - 1; i >= 0; i-- {
			cleanups[i]()
		}
	}()
	pair := func(podMTU int) (*netnstest.Pair, error) {
		prefix, release, err := netnstest.Claim()
		if err != nil {
			return nil, err
		}
		p, err := netnstest.NewPair(prefix, podMTU)
		if err != nil {
			release()
			return nil, err
		}
		cleanups = append(cleanups, func() { p.Close(); release() })
		return p, nil
	}
	// Baselines: the underlay and kernel VXLAN, between the node namespaces.
	p, err := pair(1500)
	if err != nil {
		return err
	}
	if err := vxlan(b.ctx, p); err != nil {
		return err
	}
	a, bn := p.Nodes[0], p.Nodes[1]
	paths = append(paths,
		path{"raw veth underlay (node to node)", false, a.NS, bn.NS, bn.Underlay},
		path{"kernel VXLAN (node to node)", false, a.NS, bn.NS, netip.MustParseAddr("10.99.0.2")})
	if naive {
		mtu := 1500 - tunnel.Overhead(tunnel.ModeUDP)
		p, err := pair(mtu)
		if err != nil {
			return err
		}
		stop, err := startNaive(p, mtu)
		if err != nil {
			return err
		}
		cleanups = append(cleanups, stop)
		paths = append(paths, path{"naive TUN/UDP forwarder, one goroutine each way (pod to pod)", true, p.Nodes[0].Pod, p.Nodes[1].Pod, p.Nodes[1].PodAddr})
	}
	for _, m := range modes {
		var psk []byte
		if m == encryptedUDP {
			m, psk = "udp", bytes.Repeat([]byte{7}, crypt.KeySize) // as crypt.DeriveKeys would give
		}
		mode, err := tunnel.ParseMode(m)
		if err != nil {
			return err
		}
		mtu := 1500 - tunnel.Overhead(mode)
		p, err := pair(mtu)
		if err != nil {
			return err
		}
		stop, kernel, err := b.startWeft(p, mode, mtu, psk)
		if err != nil {
			return err
		}
		cleanups = append(cleanups, stop)
		name := "weft " + string(mode)
		if psk != nil {
			name += ", encrypted (" + crypt.AEADName + ")"
		}
		if mode == tunnel.ModeIPIP {
			name += map[bool]string{true: " (kernel IPIP)", false: " (userspace IPIP: TUN + raw socket)"}[kernel]
		}
		paths = append(paths, path{name + " (pod to pod)", !kernel, p.Nodes[0].Pod, p.Nodes[1].Pod, p.Nodes[1].PodAddr})
	}
	type key struct{ path, streams int }
	gbps, cpu, retrans := map[key][]float64{}, map[key][]float64{}, map[key]int{}
	for r := range b.runs {
		for pi, pa := range paths {
			for _, s := range b.streams {
				g, c, rt, err := b.measure(pa, s)
				if err != nil {
					return err
				}
				fmt.Fprintf(os.Stderr, "run %d: %-66s P=%d %6.2f Gbit/s  process CPU %.2f cores  retransmits %d\n", r+1, pa.name, s, g, c, rt)
				k := key{pi, s}
				gbps[k], cpu[k] = append(gbps[k], g), append(cpu[k], c)
				retrans[k] += rt
			}
		}
	}
	for pi, pa := range paths {
		for _, s := range b.streams {
			k := key{pi, s}
			b.rows = append(b.rows, row{name: pa.name, streams: s, gbps: median(gbps[k]), cpu: median(cpu[k]), userspace: pa.userspace, retrans: retrans[k]})
		}
	}
	b.print(time.Since(start))
	return nil
}

func median(xs []float64) float64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	if len(s) == 0 {
		return 0
	}
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// startWeft runs a tunnel.Device in each node, as the router would; with
// psk, encrypted.
func (b *bench) startWeft(p *netnstest.Pair, mode tunnel.Mode, mtu int, psk []byte) (stop func(), kernel bool, err error) {
	var ds []*tunnel.Device
	ctx, cancel := context.WithCancel(b.ctx)
	done := make(chan error, 2)
	stop = func() {
		cancel()
		for range ds {
			if err := <-done; err != nil {
				b.log.Error("tunnel", "err", err)
			}
		}
	}
	for _, n := range p.Nodes {
		var d *tunnel.Device
		err := n.NS.Do(func() error {
			var err error
			d, err = tunnel.New(tunnel.Config{Self: n.Name, Mode: mode, MTU: mtu, Underlay: n.Underlay, PSK: psk, Logger: b.log.With("node", n.Name)})
			return err
		})
		if err != nil {
			stop()
			return nil, false, err
		}
		ds = append(ds, d)
		go func() { done <- d.Run(ctx) }()
	}
	var peers []tunnel.Peer
	var ring []tunnel.OwnedRange
	for i, n := range p.Nodes {
		peers = append(peers, tunnel.Peer{Name: n.Name, Underlay: n.Underlay, DataPort: tunnel.DefaultDataPort, Encaps: ds[i].Encaps(), PublicKey: ds[i].PublicKey()})
		last := n.Range.Addr().As4()
		last[1] |= 3
		last[2], last[3] = 255, 255
		ring = append(ring, tunnel.OwnedRange{First: n.Range.Addr(), Last: netip.AddrFrom4(last), Peer: n.Name})
	}
	for i, n := range p.Nodes {
		if err := ds[i].SetPeers(peers); err != nil {
			stop()
			return nil, false, err
		}
		if err := ds[i].SetRing(ring, n.Gateway); err != nil {
			stop()
			return nil, false, err
		}
	}
	return stop, ds[0].KernelIPIP(), nil
}

// startNaive runs the forwarder the issue measures weft against: per
// node, one goroutine reads one packet at a time from the TUN device and
// sends it in a udp frame, another receives one datagram at a time and
// writes it to the TUN device.
func startNaive(p *netnstest.Pair, mtu int) (stop func(), err error) {
	var closers []func()
	stop = func() {
		for _, c := range closers {
			c()
		}
	}
	for i, n := range p.Nodes {
		other := p.Nodes[1-i]
		var dev tun.Device
		var c *net.UDPConn
		err := n.NS.Do(func() error {
			var err error
			if dev, err = tun.Open("naive", mtu, 1); err != nil {
				return err
			}
			c, err = net.ListenUDP("udp4", &net.UDPAddr{Port: tunnel.DefaultDataPort})
			return err
		})
		if err != nil {
			stop()
			return nil, err
		}
		closers = append(closers, func() { dev.Close(); c.Close() })
		if _, err := n.NS.Exec(context.Background(), "ip", "route", "add", other.Range.String(), "dev", "naive", "src", n.Gateway.String()); err != nil {
			stop()
			return nil, err
		}
		q := dev.Queues()[0]
		peer := netip.AddrPortFrom(other.Underlay, tunnel.DefaultDataPort)
		go func() {
			buf := make([]byte, 65536)
			bufs, sizes := [][]byte{buf}, []int{0}
			for {
				if _, err := q.Read(bufs, sizes, tunnel.FrameHeaderLen); err != nil {
					return
				}
				tunnel.PutFrameHeader(buf, tunnel.FrameHeader{Version: tunnel.FrameVersion, Type: tunnel.FrameData})
				if _, err := c.WriteToUDPAddrPort(buf[:tunnel.FrameHeaderLen+sizes[0]], peer); err != nil && errors.Is(err, net.ErrClosed) {
					return
				}
			}
		}()
		go func() {
			buf := make([]byte, 65536)
			for {
				k, _, err := c.ReadFromUDPAddrPort(buf)
				if err != nil {
					return
				}
				if _, _, err := tunnel.DecodeFrame(buf[:k]); err != nil {
					continue
				}
				if _, err := q.Write([][]byte{buf[:k]}, tunnel.FrameHeaderLen); errors.Is(err, tun.ErrClosed) {
					return
				}
			}
		}()
	}
	return stop, nil
}

// vxlan joins the two nodes with kernel VXLAN devices, 10.99.0.1 and .2.
func vxlan(ctx context.Context, p *netnstest.Pair) error {
	for i, n := range p.Nodes {
		other := p.Nodes[1-i]
		for _, c := range [][]string{
			{"ip", "link", "add", "vx0", "type", "vxlan", "id", "42", "local", n.Underlay.String(), "remote", other.Underlay.String(), "dstport", "4789", "dev", "ul0"},
			{"ip", "addr", "add", fmt.Sprintf("10.99.0.%d/24", i+1), "dev", "vx0"},
			{"ip", "link", "set", "vx0", "up"},
		} {
			if _, err := n.NS.Exec(ctx, c...); err != nil {
				return err
			}
		}
	}
	return nil
}

// measure runs iperf3 over pa with the given streams and returns the
// received rate, this process's CPU use meanwhile, and the retransmits.
func (b *bench) measure(pa path, streams int) (gbps, cpu float64, retrans int, err error) {
	srv := pa.server.Command(b.ctx, "iperf3", "-s", "-1", "-B", pa.addr.String())
	if err := srv.Start(); err != nil {
		return 0, 0, 0, fmt.Errorf("iperf3 server in %s: %w", pa.server.Name, err)
	}
	defer func() { _ = srv.Process.Kill(); _ = srv.Wait() }()
	if err := waitListening(b.ctx, pa.server, 5201); err != nil {
		return 0, 0, 0, err
	}
	before, t0 := cpuTime(), time.Now()
	secs := strconv.Itoa(int(b.dur.Seconds()))
	out, err := pa.client.Exec(b.ctx, "iperf3", "-c", pa.addr.String(), "-t", secs, "-O", "1", "-P", strconv.Itoa(streams), "-J")
	cpu = (cpuTime() - before).Seconds() / time.Since(t0).Seconds()
	if err != nil {
		return 0, 0, 0, fmt.Errorf("%s: %w", pa.name, err)
	}
	var res struct {
		End struct {
			SumSent     struct{ Retransmits int } `json:"sum_sent"`
			SumReceived struct {
				BitsPerSecond float64 `json:"bits_per_second"`
			} `json:"sum_received"`
		} `json:"end"`
	}
	if err := json.Unmarshal(out, &res); err != nil {
		return 0, 0, 0, fmt.Errorf("%s: iperf3 output: %w", pa.name, err)
	}
	return res.End.SumReceived.BitsPerSecond / 1e9, cpu, res.End.SumSent.Retransmits, nil
}

func waitListening(ctx context.Context, n *netnstest.NS, port int) error {
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) {
		out, _ := n.Exec(ctx, "ss", "-Hltn", "sport", "= :"+strconv.Itoa(port))
		if strings.TrimSpace(string(out)) != "" {
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
	return fmt.Errorf("iperf3 server in %s not listening within 5s", n.Name)
}

// cpuTime is the user and system CPU time of this process so far.
func cpuTime() time.Duration {
	var ru unix.Rusage
	_ = unix.Getrusage(unix.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

func (b *bench) print(took time.Duration) {
	under := map[int]float64{}
	for _, r := range b.rows {
		if strings.HasPrefix(r.name, "raw veth") {
			under[r.streams] = r.gbps
		}
	}
	fmt.Printf("Measured %s (%s in all; each row the median of %d runs of %s):\n\n", time.Now().Format("2006-01-02"), took.Round(time.Second), b.runs, b.dur)
	fmt.Println("| path | streams | Gbit/s | of the underlay | forwarder CPU (cores) | forwarder CPU per Gbit/s | TCP retransmits (all runs) |")
	fmt.Println("|---|---|---|---|---|---|---|")
	for _, r := range b.rows {
		cpu, per := "kernel", "kernel"
		if r.userspace {
			cpu = fmt.Sprintf("%.2f", r.cpu)
			per = fmt.Sprintf("%.2f", r.cpu/r.gbps)
		}
		ratio := "—"
		if u := under[r.streams]; u > 0 {
			ratio = fmt.Sprintf("%.3f", r.gbps/u)
		}
		fmt.Printf("| %s | %d | %.2f | %s | %s | %s | %d |\n", r.name, r.streams, r.gbps, ratio, cpu, per, r.retrans)
	}
	plain := map[int]row{}
	for _, r := range b.rows {
		if r.name == "weft udp (pod to pod)" {
			plain[r.streams] = r
		}
	}
	for _, r := range b.rows {
		if p, ok := plain[r.streams]; ok && strings.HasPrefix(r.name, "weft udp, encrypted") && p.gbps > 0 {
			fmt.Printf("\nEncrypted udp with %d stream(s): %.3f of unencrypted udp's throughput, %.2f× its CPU per Gbit/s.\n",
				r.streams, r.gbps/p.gbps, (r.cpu/r.gbps)/(p.cpu/p.gbps))
		}
	}
}
