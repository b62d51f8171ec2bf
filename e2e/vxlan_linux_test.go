package e2e

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/weft-net/weft/internal/syncbuf"
	"github.com/weft-net/weft/tunnel"
)

// vxlanDev is the kernel VXLAN device of --encap vxlan (tunnel.DefaultVXLANName).
const vxlanDev = "weft-vx"

// flow is a continuous ping (every 50 ms) from one pod to another: the
// ping(8) of the pod's namespace, stopped with SIGINT for its summary.
type flow struct {
	from, to *Pod
	cmd      *exec.Cmd
	out      *syncbuf.Buffer
	done     chan error
}

func startFlow(t *testing.T, from, to *Pod) *flow {
	t.Helper()
	f := &flow{from: from, to: to, out: &syncbuf.Buffer{}, done: make(chan error, 1)}
	err := from.NS.Do(func() error {
		f.cmd = exec.Command("ping", "-n", "-i", "0.05", "-W", "1", to.IP.String())
		f.cmd.Stdout, f.cmd.Stderr = f.out, f.out
		return f.cmd.Start() // forked on this thread: in the pod's namespace
	})
	if err != nil {
		t.Fatalf("starting ping from %s to %s: %v", from, to, err)
	}
	go func() { f.done <- f.cmd.Wait() }()
	t.Cleanup(func() {
		if f.cmd.ProcessState == nil {
			f.cmd.Process.Kill()
			<-f.done
		}
	})
	return f
}

// replies is the number of echo replies so far.
func (f *flow) replies() int { return strings.Count(f.out.String(), " bytes from ") }

var pingSummary = regexp.MustCompile(`(\d+) packets transmitted, (\d+) received`)

// stop ends the ping and returns what it sent and got back.
func (f *flow) stop(t *testing.T) (sent, received int) {
	t.Helper()
	f.cmd.Process.Signal(os.Interrupt)
	select {
	case <-f.done:
	case <-time.After(10 * time.Second):
		f.cmd.Process.Kill()
		<-f.done
	}
	m := pingSummary.FindStringSubmatch(f.out.String())
	if m == nil {
		t.Fatalf("no summary from ping %s -> %s:\n%s", f.from, f.to, f.out.String())
	}
	sent, _ = strconv.Atoi(m[1])
	received, _ = strconv.Atoi(m[2])
	return sent, received
}

// waitReplies waits until the flow has n more replies than it had at
// the call: the traffic goes on.
func (f *flow) waitReplies(t *testing.T, ctx context.Context, what string, n int) {
	t.Helper()
	base := f.replies()
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second) // 20 replies a second when it flows
	defer cancel()
	waitUntil(t, ctx, what, func() (bool, string) {
		got := f.replies() - base
		return got >= n, fmt.Sprintf("%d of %d replies from %s to %s", got, n, f.from, f.to)
	})
}

// vxlanEntries is what node n's kernel has on its VXLAN device: routes,
// neighbours and FDB entries.
func vxlanEntries(ctx context.Context, n *Node) string {
	var b strings.Builder
	for _, argv := range [][]string{
		{"ip", "-d", "link", "show", vxlanDev},
		{"ip", "route", "show", "dev", vxlanDev},
		{"ip", "neigh", "show", "dev", vxlanDev},
		{"bridge", "fdb", "show", "dev", vxlanDev},
	} {
		out, err := n.NS.Exec(ctx, argv...)
		if err != nil {
			fmt.Fprintf(&b, "%v: %v\n", argv, err)
		}
		b.Write(out)
	}
	return b.String()
}

// tcpFlow is one TCP connection between two pods that carries a small
// message every 20 ms and its echo: a connection that a broken path or a
// reset would end.
type tcpFlow struct {
	from, to *Pod
	trips    atomic.Int64 // messages echoed
	done     chan error
	stopc    chan struct{}
	conn     net.Conn
	ln       net.Listener
}

// startTCPFlow opens the connection (the sockets are made in the pods'
// namespaces) and starts the messages.
func startTCPFlow(t *testing.T, ctx context.Context, from, to *Pod) *tcpFlow {
	t.Helper()
	f := &tcpFlow{from: from, to: to, done: make(chan error, 1), stopc: make(chan struct{})}
	if err := to.NS.Do(func() (err error) {
		f.ln, err = net.Listen("tcp", netip.AddrPortFrom(to.IP, 5202).String())
		return err
	}); err != nil {
		t.Fatalf("listening in %s: %v", to, err)
	}
	go func() {
		c, err := f.ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		io.Copy(c, c) // echo until the client closes
	}()
	if err := from.NS.Do(func() (err error) {
		d := net.Dialer{Timeout: 10 * time.Second}
		f.conn, err = d.DialContext(ctx, "tcp", netip.AddrPortFrom(to.IP, 5202).String())
		return err
	}); err != nil {
		f.ln.Close()
		t.Fatalf("connecting from %s to %s: %v", from, to, err)
	}
	go func() {
		msg, back := make([]byte, 64), make([]byte, 64)
		tick := time.NewTicker(20 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-f.stopc:
				f.done <- nil
				return
			case <-tick.C:
			}
			// A message must come back within 30 s: TCP retransmits
			// across a short outage, a reset or a dead path ends it.
			f.conn.SetDeadline(time.Now().Add(30 * time.Second))
			if _, err := f.conn.Write(msg); err != nil {
				f.done <- err
				return
			}
			if _, err := io.ReadFull(f.conn, back); err != nil {
				f.done <- err
				return
			}
			f.trips.Add(1)
		}
	}()
	t.Cleanup(func() { f.conn.Close(); f.ln.Close() })
	return f
}

// waitTrips waits until n more messages went there and back.
func (f *tcpFlow) waitTrips(t *testing.T, ctx context.Context, what string, n int64) {
	t.Helper()
	base := f.trips.Load()
	waitUntil(t, ctx, what, func() (bool, string) {
		select {
		case err := <-f.done:
			f.done <- err
			return true, ""
		default:
		}
		got := f.trips.Load() - base
		return got >= n, fmt.Sprintf("%d of %d messages echoed", got, n)
	})
	select {
	case err := <-f.done:
		t.Fatalf("the TCP connection %s -> %s ended: %v", f.from, f.to, err)
	default:
	}
}

// stop ends the messages; the connection must not have failed.
func (f *tcpFlow) stop(t *testing.T) int64 {
	t.Helper()
	close(f.stopc)
	if err := <-f.done; err != nil {
		t.Errorf("the TCP connection %s -> %s failed: %v", f.from, f.to, err)
	}
	return f.trips.Load()
}

// TestVXLAN: three nodes with --encap vxlan. Every pod reaches every other
// pod and every node through the kernel's VXLAN device (a route, a
// permanent neighbour and an FDB entry per peer), TCP crosses intact; the
// kernel objects outlive the router: under a continuous pod-to-pod ping, a
// router killed with SIGKILL, and another stopped with SIGTERM, lose no
// traffic while they are down and after they are back; weft reset removes
// the device.
func TestVXLAN(t *testing.T) {
	c, ctx := startMeshCluster(t, 3, "--encap", "vxlan")
	waitModes(t, ctx, c, "vxlan")
	var pods []*Pod
	for _, n := range c.Nodes {
		for i := range 2 {
			p, err := n.AddPod(ctx, fmt.Sprintf("p%d", i))
			if err != nil {
				t.Fatal(err)
			}
			pods = append(pods, p)
		}
	}
	pingAll(t, ctx, c, pods)
	for _, n := range c.Nodes {
		st := vxlanEntries(ctx, n)
		for _, o := range c.Nodes {
			if o == n {
				continue
			}
			if !strings.Contains(st, o.UnderlayIP.String()+" dev "+vxlanDev+" lladdr") && !strings.Contains(st, o.UnderlayIP.String()+" lladdr") {
				t.Errorf("%s has no neighbour for %s on %s:\n%s", n.Name, o.Name, vxlanDev, st)
			}
			if !strings.Contains(st, "dst "+o.UnderlayIP.String()+" self permanent") {
				t.Errorf("%s has no FDB entry to %s on %s:\n%s", n.Name, o.Name, vxlanDev, st)
			}
		}
		if !strings.Contains(st, "nolearning") || !strings.Contains(st, "dstport 4789") {
			t.Errorf("%s: %s is not as documented (nolearning, dstport 4789):\n%s", n.Name, vxlanDev, st)
		}
	}
	// TCP between every pair of nodes.
	for i, from := range []*Pod{pods[0], pods[2], pods[4]} {
		to := pods[(2*i+3)%len(pods)]
		tctx, cancel := context.WithTimeout(ctx, 60*time.Second)
		err := transfer(tctx, from, to, 10<<20)
		cancel()
		if err != nil {
			t.Fatalf("10 MB from %s to %s: %v\n%s", from, to, err, routerLogs(c))
		}
	}
	// VXLAN between the nodes is not tracked by conntrack (its flows are
	// one-way); the pods' connections that it carried are.
	for _, n := range c.Nodes {
		var vx, podTCP int
		err := n.NS.WithHandle(func(h *netlink.Handle) error {
			flows, err := h.ConntrackTableList(netlink.ConntrackTable, unix.AF_INET)
			for _, f := range flows {
				switch {
				case f.Forward.Protocol == unix.IPPROTO_UDP && (f.Forward.DstPort == 4789 || f.Reverse.DstPort == 4789):
					vx++
				case f.Forward.Protocol == unix.IPPROTO_TCP && slices.ContainsFunc(pods, func(p *Pod) bool { return net.IP(p.IP.AsSlice()).Equal(f.Forward.SrcIP) }):
					podTCP++
				}
			}
			return err
		})
		if err != nil {
			t.Fatalf("%s: conntrack table: %v", n.Name, err)
		}
		if vx != 0 || podTCP == 0 {
			t.Errorf("%s: %d conntrack entries of VXLAN (udp/4789), want none; %d of the pods' TCP, want some", n.Name, vx, podTCP)
		}
	}

	n0, n1, n2 := c.Nodes[0], c.Nodes[1], c.Nodes[2]
	seen := func(by []*Node, who *Node, state string) func() (bool, string) {
		return func() (bool, string) {
			var s []string
			for _, n := range by {
				st := peerStates(ctx, n)
				s = append(s, fmt.Sprintf("%s:%v", n.Name, st))
				if st[who.PeerName] != state {
					return false, strings.Join(s, " ")
				}
			}
			return true, ""
		}
	}

	// kill -9 of n2's router under a ping and a TCP connection from n0
	// to n2.
	f := startFlow(t, pods[0], pods[4])
	f.waitReplies(t, ctx, "the ping to answer", 20)
	tf := startTCPFlow(t, ctx, pods[0], pods[4])
	tf.waitTrips(t, ctx, "the TCP connection to carry", 10)
	if err := n2.Router().Kill(); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, ctx, "n0 and n1 to see n2's router gone", seen([]*Node{n0, n1}, n2, "unreachable"))
	f.waitReplies(t, ctx, "the ping to go on while n2 has no router", 40)
	for _, pair := range [][2]*Pod{{pods[2], pods[5]}, {pods[5], pods[1]}} {
		if err := Ping(ctx, pair[0].NS, pair[1].IP); err != nil {
			t.Errorf("with n2's router dead: %v\n%s", err, vxlanEntries(ctx, n2))
		}
	}
	tf.waitTrips(t, ctx, "the TCP connection to go on while n2 has no router", 20)
	restartVXLANRouter(t, ctx, c, n2)
	f.waitReplies(t, ctx, "the ping to go on after n2's router is back", 40)
	tf.waitTrips(t, ctx, "the TCP connection to go on after n2's router is back", 20)
	t.Logf("kill -9 of n2's router: the TCP connection %s -> %s carried %d messages across it", tf.from, tf.to, tf.stop(t))
	sent, got := f.stop(t)
	t.Logf("kill -9 of n2's router: ping %s -> %s every 50 ms: %d sent, %d received, %d lost", f.from, f.to, sent, got, sent-got)
	if lost := sent - got; lost > 5 {
		t.Errorf("kill -9 of a router lost %d of %d packets of a pod-to-pod ping, want at most a few\n%s", lost, sent, routerLogs(c))
	}

	// SIGTERM of n1's router (a rollout) under a ping from n0 to n1: its
	// peers see it leave, and keep its entries.
	f = startFlow(t, pods[1], pods[3])
	f.waitReplies(t, ctx, "the ping to answer", 20)
	if err := n1.Router().Stop(); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, ctx, "n0 and n2 to see n1 leave", seen([]*Node{n0, n2}, n1, "left"))
	f.waitReplies(t, ctx, "the ping to go on while n1 has no router", 40)
	restartVXLANRouter(t, ctx, c, n1)
	f.waitReplies(t, ctx, "the ping to go on after n1's router is back", 40)
	sent, got = f.stop(t)
	t.Logf("SIGTERM of n1's router: ping %s -> %s every 50 ms: %d sent, %d received, %d lost", f.from, f.to, sent, got, sent-got)
	if lost := sent - got; lost > 5 {
		t.Errorf("a router's SIGTERM lost %d of %d packets of a pod-to-pod ping, want at most a few\n%s", lost, sent, routerLogs(c))
	}
	pingAll(t, ctx, c, pods)

	// weft reset on n2 removes the VXLAN device.
	for _, p := range pods[4:] {
		if err := n2.RemovePod(ctx, p); err != nil {
			t.Fatal(err)
		}
	}
	if out, err := n2.Weft(ctx, "reset"); err != nil {
		t.Fatalf("weft reset: %s (%v)", out, err)
	}
	if err := n2.Router().Proc().Wait(); err != nil {
		t.Errorf("the router exited with %v after reset", err)
	}
	err := n2.NS.WithHandle(func(h *netlink.Handle) error {
		_, err := h.LinkByName(vxlanDev)
		return err
	})
	if !errors.As(err, new(netlink.LinkNotFoundError)) {
		t.Errorf("%s after weft reset: %v\n%s", vxlanDev, err, vxlanEntries(ctx, n2))
	}
}

// restartVXLANRouter starts n's router again and waits until it is ready
// and every node sends to every other with vxlan again.
func restartVXLANRouter(t *testing.T, ctx context.Context, c *Cluster, n *Node) {
	t.Helper()
	if err := n.Router().Restart(); err != nil {
		t.Fatal(err)
	}
	if err := n.WaitReady(ctx); err != nil {
		t.Fatal(err)
	}
	waitModes(t, ctx, c, "vxlan")
}

// TestVXLANPassword: a router with a password and --encap vxlan but no
// --trusted-subnets refuses to start and says what to do.
func TestVXLANPassword(t *testing.T) {
	if testing.Short() {
		t.Skip("e2e: skipped in -short mode")
	}
	run := NewTestRun(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	c, err := run.NewCluster(ctx, ClusterOpts{Nodes: 1})
	if err != nil {
		t.Fatal(err)
	}
	n := c.Nodes[0]
	pw := n.Dir + "/password"
	if err := os.WriteFile(pw, []byte("a-long-enough-password"), 0o600); err != nil {
		t.Fatal(err)
	}
	r, err := n.StartRouter("--encap", "vxlan", "--password-file", pw)
	if err != nil {
		t.Fatal(err)
	}
	select {
	case <-r.Proc().Exited():
	case <-ctx.Done():
		t.Fatal("the router started with --encap vxlan and a password, without --trusted-subnets")
	}
	if log := r.LogTail(20); !strings.Contains(log, "--trusted-subnets") || !strings.Contains(log, "--encap udp") {
		t.Errorf("the router's error does not say what to do:\n%s", log)
	}
	if out, err := n.NS.Exec(ctx, "ip", "link", "show", vxlanDev); err == nil {
		t.Errorf("a refused start made %s:\n%s", vxlanDev, out)
	}
}

// vxlanFrame is a VXLAN packet's UDP payload: the VXLAN header with vni,
// an Ethernet header from src to dst, and the IPv4 packet inner.
func vxlanFrame(vni uint32, dst, src [6]byte, inner []byte) []byte {
	b := []byte{0x08, 0, 0, 0, byte(vni >> 16), byte(vni >> 8), byte(vni), 0}
	b = append(b, dst[:]...)
	b = append(b, src[:]...)
	b = append(b, 0x08, 0x00)
	return append(b, inner...)
}

// vxlanVictim is a pod of node to that listens for forged datagrams, and
// the VXLAN packets an attacker sends to its node: an inner UDP datagram
// to the pod, in an Ethernet frame from the VTEP of peer from to the VTEP
// of to, as peer from's kernel would send it.
type vxlanVictim struct {
	pod      *Pod
	sink     *udpSink
	to, from *Node
	port     netip.AddrPort // to's VXLAN port
	marker   string
	sent     int
}

func newVXLANVictim(t *testing.T, ctx context.Context, to, from *Node) *vxlanVictim {
	t.Helper()
	pod, err := to.AddPod(ctx, "target")
	if err != nil {
		t.Fatal(err)
	}
	return &vxlanVictim{pod: pod, sink: listenUDP(t, pod, hostilePort), to: to, from: from,
		port: netip.AddrPortFrom(to.UnderlayIP, tunnel.DefaultVXLANPort), marker: newMarker("forged")}
}

// packet is the VXLAN payload of a datagram from src to dst:hostilePort.
func (v *vxlanVictim) packet(src, dst netip.Addr, payload []byte) []byte {
	inner := ipv4UDP(netip.AddrPortFrom(src, 40000), netip.AddrPortFrom(dst, hostilePort), payload)
	return vxlanFrame(tunnel.DefaultVNI, tunnel.VTEPMAC(v.to.PeerName), tunnel.VTEPMAC(v.from.PeerName), inner)
}

// forge sends from ns, to port, one forged datagram (a fresh sequence
// number of the marker) per source in srcs, to the pod.
func (v *vxlanVictim) forge(t *testing.T, ns *Netns, port netip.AddrPort, srcs ...netip.Addr) {
	t.Helper()
	for _, src := range srcs {
		v.sent++
		if err := sendUDP(ns, port, v.packet(src, v.pod.IP, markerDatagram(v.marker, v.sent))); err != nil {
			t.Fatal(err)
		}
	}
}

// dropped sends with send and waits (20 s at most) for n's guard to count
// the drops want; it returns what grew.
func (v *vxlanVictim) dropped(t *testing.T, ctx context.Context, n *Node, what string, want map[string]float64, send func()) map[string]float64 {
	t.Helper()
	before := guardDropsNow(t, ctx, n)
	send()
	wctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	return waitGrown(t, wctx, what, func() (map[string]float64, error) { return guardDrops(wctx, n) }, before, want)
}

// control sends the legitimate datagram, from peer from's pod at src, and
// wants it to be the first the pod receives: none of the forged ones came
// before it.
func (v *vxlanVictim) control(t *testing.T, ctx context.Context, src netip.Addr) {
	t.Helper()
	expectControl(t, ctx, func(payload []byte) error { return sendUDP(v.from.NS, v.port, v.packet(src, v.pod.IP, payload)) }, v.sink, v.pod)
}

// TestVXLANFromNonPeer is the attacker's side of vxlan: a host on the
// underlay that is no peer sends well-formed VXLAN packets to a node's
// port 4789, with an inner packet from a pod of another node to a pod of
// this one. The guard drops them (vxlan-non-peer), the pod gets nothing;
// the same packet from a peer's address (the control) arrives first. A pod
// that sends it to a node's VXLAN port is dropped too (pod-to-router).
// With --encap vxlan and with auto.
func TestVXLANFromNonPeer(t *testing.T) {
	for _, encap := range []string{"vxlan", "auto"} {
		t.Run(encap, func(t *testing.T) { vxlanFromNonPeer(t, encap) })
	}
}

func vxlanFromNonPeer(t *testing.T, encap string) {
	c, ctx := startMeshCluster(t, 2, "--encap", encap)
	waitModes(t, ctx, c, "vxlan")
	n0, n1 := c.Nodes[0], c.Nodes[1]
	v := newVXLANVictim(t, ctx, n0, n1)
	remote, err := n1.AddPod(ctx, "remote")
	if err != nil {
		t.Fatal(err)
	}
	evil, err := c.AddNode(ctx, "evil") // on the underlay, no router: no peer
	if err != nil {
		t.Fatal(err)
	}
	v.dropped(t, ctx, n0, "n0's guard to drop VXLAN from a non-peer", map[string]float64{"vxlan-non-peer": 3}, func() {
		v.forge(t, evil.NS, v.port, remote.IP, remote.IP, remote.IP)
	})

	// A pod of n1 sends the same packet (its own address inside) to n0's
	// VXLAN port, and to its own node's: n1 would masquerade the first to
	// its own underlay address, a peer's, so n1's guard drops both.
	v.dropped(t, ctx, n1, "n1's guard to drop its pod's VXLAN", map[string]float64{"pod-to-router": 2}, func() {
		v.forge(t, remote.NS, v.port, remote.IP)
		v.forge(t, remote.NS, netip.AddrPortFrom(n1.UnderlayIP, tunnel.DefaultVXLANPort), remote.IP)
	})
	v.control(t, ctx, remote.IP)
}

// TestVXLANFromUntrustedPeer: with a password, VXLAN is taken only from
// the peers inside --trusted-subnets. n2 is a peer outside them (n0 talks
// to it sealed, or not at all, never plaintext), so well-formed VXLAN
// from n2's underlay address, as someone who spoofs it would send, is
// dropped (vxlan-non-peer) and the pod gets nothing. n3 is inside the
// trusted subnets but runs a router without the password: it is refused
// by the mesh, so it is no peer, and its VXLAN is dropped too. The same
// packet from n1, a peer inside the trusted subnets, arrives (the
// control). The same with --encap auto, where n0 sends to n2 with sealed
// udp (and n2, outside the trusted subnets, has no weft-vx).
func TestVXLANFromUntrustedPeer(t *testing.T) {
	if testing.Short() {
		t.Skip("e2e: skipped in -short mode")
	}
	for _, encap := range []string{"vxlan", "auto"} {
		t.Run(encap, func(t *testing.T) { vxlanFromUntrustedPeer(t, encap) })
	}
}

func vxlanFromUntrustedPeer(t *testing.T, encap string) {
	run := NewTestRun(t)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	c, err := run.NewCluster(ctx, ClusterOpts{Nodes: 4})
	if err != nil {
		t.Fatal(err)
	}
	n0, n1, n2, n3 := c.Nodes[0], c.Nodes[1], c.Nodes[2], c.Nodes[3]
	pw := writePassword(t, "pw", "a shared secret for the untrusted vxlan peer test")
	var all []string
	for _, n := range c.Nodes {
		all = append(all, n.UnderlayIP.String())
	}
	trusted := n0.UnderlayIP.String() + "/32," + n1.UnderlayIP.String() + "/32," + n3.UnderlayIP.String() + "/32"
	for _, n := range c.Nodes[:3] {
		if _, err := n.StartRouter("--peers", strings.Join(all, ","), "--encap", encap, "--password-file", pw, "--trusted-subnets", trusted); err != nil {
			t.Fatal(err)
		}
	}
	// n3: a router without the password, inside the trusted subnets.
	if _, err := n3.StartRouter("--peers", strings.Join(all, ","), "--encap", encap); err != nil {
		t.Fatal(err)
	}
	for _, n := range []*Node{n0, n1} {
		if err := n.WaitReady(ctx); err != nil {
			t.Fatal(err)
		}
	}
	want2 := "" // --encap vxlan: no data path to n2, never plaintext
	if encap == "auto" {
		want2 = "udp" // sealed
	}
	waitUntil(t, ctx, fmt.Sprintf("n0 to send vxlan to n1 and know n2 (with mode %q)", want2), func() (bool, string) {
		m, err := dataModes(ctx, n0)
		mode2, known2 := m[n2.PeerName]
		return err == nil && m[n1.PeerName] == "vxlan" && known2 && mode2 == want2, fmt.Sprintf("%v %v", m, err)
	})
	if encap == "auto" {
		wantStatus(t, ctx, n0, n2, "udp", "encrypted: outside trusted subnets")
		if hasVXLANDevice(n2) {
			t.Errorf("n2, outside the trusted subnets, has %s with auto", vxlanDev)
		}
	}
	v := newVXLANVictim(t, ctx, n0, n1)
	remote, err := n1.AddPod(ctx, "remote")
	if err != nil {
		t.Fatal(err)
	}
	v.dropped(t, ctx, n0, "n0's guard to drop VXLAN from a peer outside the trusted subnets", map[string]float64{"vxlan-non-peer": 3}, func() {
		v.forge(t, n2.NS, v.port, remote.IP, remote.IP, remote.IP)
	})
	// n0 has refused n3 (it says so in its log) and does not count it
	// among its peers; n3's VXLAN, from its own address inside the
	// trusted subnets, is dropped as a non-peer's.
	waitUntil(t, ctx, "n0 to refuse n3, which has no password", func() (bool, string) {
		return authFailureHosts(n0)[n3.UnderlayIP.String()] > 0, fmt.Sprint(authFailureHosts(n0))
	})
	if st := peerStates(ctx, n0); st["error"] != "" || st[n3.PeerName] != "" || len(st) != 3 {
		t.Fatalf("n0's peers (want n0, n1, n2 and not n3, a router without the password): %v", st)
	}
	v.dropped(t, ctx, n0, "n0's guard to drop VXLAN from a router without the password", map[string]float64{"vxlan-non-peer": 2}, func() {
		v.forge(t, n3.NS, v.port, remote.IP, remote.IP)
	})
	v.control(t, ctx, remote.IP)
}

// TestVXLANSpoofedInnerSource is the attacker's side of vxlan from a peer:
// n1, a real peer (or whoever sends from its underlay address), sends
// well-formed VXLAN to n0's port 4789 whose inner packet, to a pod of n0,
// comes from (a) an address outside the pod range, or (b) another pod of
// n0 itself. n0's guard drops both after the decapsulation
// (vxlan-spoofed-source) and the pod gets nothing; the same packet from
// n1's real pod (the control) arrives first. A packet from n1's pod to a
// host outside the pod range, for n0 to relay, is dropped too
// (vxlan-not-to-pods). With --encap vxlan and with auto.
func TestVXLANSpoofedInnerSource(t *testing.T) {
	for _, encap := range []string{"vxlan", "auto"} {
		t.Run(encap, func(t *testing.T) { vxlanSpoofedInnerSource(t, encap) })
	}
}

func vxlanSpoofedInnerSource(t *testing.T, encap string) {
	c, ctx := startMeshCluster(t, 2, "--encap", encap)
	waitModes(t, ctx, c, "vxlan")
	n0, n1 := c.Nodes[0], c.Nodes[1]
	v := newVXLANVictim(t, ctx, n0, n1)
	neighbour, err := n0.AddPod(ctx, "neighbour") // the pod whose address the peer forges
	if err != nil {
		t.Fatal(err)
	}
	remote, err := n1.AddPod(ctx, "remote")
	if err != nil {
		t.Fatal(err)
	}
	// n0's router has put its own ranges into the guard (set own).
	waitUntil(t, ctx, "n0's guard to hold its own ranges", func() (bool, string) {
		out, err := n0.NS.Exec(ctx, "nft", "get", "element", "ip", "weft", "own", "{", neighbour.IP.String(), "}")
		return err == nil, fmt.Sprintf("%s %v", out, err)
	})
	if out, err := n0.NS.Exec(ctx, "nft", "list", "table", "ip", "weft"); err == nil {
		t.Logf("n0's table ip weft:\n%s", out)
	}
	diff := v.dropped(t, ctx, n0, "n0's guard to drop VXLAN with a spoofed inner source", map[string]float64{"vxlan-spoofed-source": 3}, func() {
		v.forge(t, n1.NS, v.port, netip.MustParseAddr("192.0.2.77"), n1.UnderlayIP, neighbour.IP)
	})
	if diff["vxlan-non-peer"] != 0 {
		t.Errorf("n0 counted VXLAN from its peer n1 as vxlan-non-peer: %v", diff)
	}
	// (c) n1's pod's packet to a host outside the pod range (n1's own
	// underlay address), through n0 as a relay: dropped (vxlan-not-to-pods).
	v.dropped(t, ctx, n0, "n0's guard to drop VXLAN to outside the pod range", map[string]float64{"vxlan-not-to-pods": 1}, func() {
		v.sent++
		if err := sendUDP(n1.NS, v.port, v.packet(remote.IP, n1.UnderlayIP, markerDatagram(v.marker, v.sent))); err != nil {
			t.Fatal(err)
		}
	})
	v.control(t, ctx, remote.IP)
}

func guardDropsNow(t *testing.T, ctx context.Context, n *Node) map[string]float64 {
	t.Helper()
	m, err := guardDrops(ctx, n)
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// TestVXLANNodeTrafficMasqueraded is TestNodeTrafficMasqueraded with
// --encap vxlan: a node's own traffic to a pod on another node that a
// masquerade on the VXLAN device gives the device's address (kube-proxy's
// rule for a NodePort, or a ClusterIP from a host-network pod, whose
// endpoint is a pod on another node) reaches the pod and the answer comes
// back: the receiving node's guard does not drop it as a spoofed inner
// source (vxlan-spoofed-source).
func TestVXLANNodeTrafficMasqueraded(t *testing.T) {
	c, ctx := startMeshCluster(t, 2, "--encap", "vxlan")
	waitModes(t, ctx, c, "vxlan")
	n0, n1 := c.Nodes[0], c.Nodes[1]
	p, err := n1.AddPod(ctx, "p0")
	if err != nil {
		t.Fatal(err)
	}
	for _, argv := range [][]string{
		{"nft", "add", "table", "ip", "kubeproxylike"},
		{"nft", "add", "chain", "ip", "kubeproxylike", "post", "{ type nat hook postrouting priority srcnat; }"},
		{"nft", "add", "rule", "ip", "kubeproxylike", "post", "oifname", vxlanDev, "ip", "saddr", n0.UnderlayIP.String(), "masquerade"},
	} {
		if out, err := n0.NS.Exec(ctx, argv...); err != nil {
			t.Fatalf("%s: %v\n%s", strings.Join(argv, " "), err, out)
		}
	}
	before, err := guardDrops(ctx, n1)
	if err != nil {
		t.Fatal(err)
	}
	pctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	var last error
	var out []byte
	for pctx.Err() == nil {
		out, last = n0.NS.Exec(pctx, "ping", "-n", "-c", "1", "-W", "1", "-I", n0.UnderlayIP.String(), p.IP.String())
		if last == nil {
			break
		}
	}
	if last != nil {
		addrs, _ := n0.NS.Exec(ctx, "ip", "-4", "addr", "show", "dev", vxlanDev)
		after, _ := guardDrops(ctx, n1)
		t.Fatalf("n0's masqueraded ping (from %s) to %s on n1: %v\n%s\n%s on n0: %s\nn1's guard drops grown: %v\n%s",
			n0.UnderlayIP, p.IP, last, out, vxlanDev, addrs, grown(before, after), routerLogs(c))
	}
	if err := Ping(ctx, n0.NS, p.IP); err != nil {
		t.Fatal(err)
	}
}

// TestVXLANDonation: with --encap vxlan, pods of a node whose addresses
// come from space donated by the other nodes reach the donors' pods and
// are reached by them: the donors take the space out of their guard's
// own set (the ring changes on the donor first), so their guards never
// drop the receiver's pods as their own (vxlan-spoofed-source).
func TestVXLANDonation(t *testing.T) {
	const universe = "10.32.0.0/26" // 64 addresses: about 21 each
	c, ctx := startMeshCluster(t, 3, "--encap", "vxlan", "--ipalloc-init", "consensus=3", "--ipalloc-range", universe)
	waitModes(t, ctx, c, "vxlan")
	n0 := c.Nodes[0]
	first, err := ownedPrefixes(ctx, n0)
	if err != nil {
		t.Fatal(err)
	}
	before := map[string]map[string]float64{}
	for _, n := range c.Nodes {
		if before[n.Name], err = guardDrops(ctx, n); err != nil {
			t.Fatal(err)
		}
	}
	var moved []*Pod
	for i := range 30 {
		p, err := n0.AddPod(ctx, fmt.Sprintf("d%02d", i))
		if err != nil {
			t.Fatalf("pod %d beyond n0's share: %v", i, err)
		}
		if !slices.ContainsFunc(first, func(o netip.Prefix) bool { return o.Contains(p.IP) }) {
			moved = append(moved, p)
		}
	}
	if len(moved) == 0 {
		t.Fatalf("no pod of n0 got an address from donated space; n0 owned %v at the start", first)
	}
	var failed []string
	for _, n := range c.Nodes[1:] {
		from, err := n.AddPod(ctx, "r0")
		if err != nil {
			t.Fatal(err)
		}
		for _, to := range moved {
			if err := Ping(ctx, from.NS, to.IP); err != nil {
				failed = append(failed, fmt.Sprintf("%s -> %s (%s)", from, to, to.IP))
			}
			if err := Ping(ctx, to.NS, from.IP); err != nil {
				failed = append(failed, fmt.Sprintf("%s (%s) -> %s", to, to.IP, from))
			}
		}
	}
	for _, n := range c.Nodes {
		after, err := guardDrops(ctx, n)
		if err != nil {
			t.Fatal(err)
		}
		if d := grown(before[n.Name], after)["vxlan-spoofed-source"]; d != 0 {
			t.Errorf("%s's guard dropped %v packets as vxlan-spoofed-source", n.Name, d)
		}
	}
	if len(failed) > 0 {
		t.Fatalf("%d moved addresses unreachable over vxlan: %v\n%s", len(failed), failed, routerLogs(c))
	}
	t.Logf("%d pods of n0 hold addresses from donated space; all reach and are reached by n1's and n2's over vxlan", len(moved))
}

// ownedPrefixes is what n's /report says it owns.
func ownedPrefixes(ctx context.Context, n *Node) ([]netip.Prefix, error) {
	data, err := n.HTTPGet(ctx, "/report")
	if err != nil {
		return nil, err
	}
	var rep struct {
		IPAM struct {
			Owned []string `json:"owned"`
		} `json:"ipam"`
	}
	if err := json.Unmarshal(data, &rep); err != nil {
		return nil, err
	}
	var out []netip.Prefix
	for _, s := range rep.IPAM.Owned {
		p, err := netip.ParsePrefix(s)
		if err != nil {
			return nil, fmt.Errorf("%s's report: owned %q: %w", n.Name, s, err)
		}
		out = append(out, p)
	}
	return out, nil
}
