package e2e

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// The security tests of issue 7, from the attacker's side: a node with the
// wrong password stays out of the mesh and cannot reach a pod, pod traffic
// on the underlay is sealed (and visible without a password, or to trusted
// subnets), and a captured frame sent again is dropped as a replay.

const (
	// dataPort is the routers' default --data-port (udp frames).
	dataPort = 6784
	// frameHeaderLen and aeadTagLen are the udp frame's header and the
	// AEAD tag of a sealed one (tunnel/frame.go, docs/security.md).
	frameHeaderLen = 16
	aeadTagLen     = 16
	// flagEncrypted is the frame flag of a sealed payload.
	flagEncrypted = 1 << 1
	// markerLen is the size of every marker datagram, so that their
	// frames have one known size.
	markerLen = 200
)

// writePassword writes a password file (mode 0600) into a directory of the
// test and returns its path.
func writePassword(t *testing.T, name, password string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(path, []byte(password+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// metricSamples fetches n's /metrics and returns the samples of metric name
// by their label set as written (e.g. `reason="auth"`; "" without labels).
func metricSamples(ctx context.Context, n *Node, name string) (map[string]float64, error) {
	data, err := n.HTTPGet(ctx, "/metrics")
	if err != nil {
		return nil, err
	}
	out := map[string]float64{}
	s := bufio.NewScanner(bytes.NewReader(data))
	s.Buffer(make([]byte, 64<<10), 1<<20)
	for s.Scan() {
		line := s.Text()
		if !strings.HasPrefix(line, name) {
			continue
		}
		rest := line[len(name):]
		labels := ""
		switch {
		case strings.HasPrefix(rest, "{"):
			end := strings.Index(rest, "}")
			if end < 0 {
				return nil, fmt.Errorf("%s /metrics: malformed line %q", n.Name, line)
			}
			labels, rest = rest[1:end], rest[end+1:]
		case strings.HasPrefix(rest, " "):
		default:
			continue // another metric whose name starts with name
		}
		f := strings.Fields(rest)
		if len(f) == 0 {
			return nil, fmt.Errorf("%s /metrics: no value in %q", n.Name, line)
		}
		v, err := strconv.ParseFloat(f[0], 64)
		if err != nil {
			return nil, fmt.Errorf("%s /metrics: value in %q: %w", n.Name, line, err)
		}
		out[labels] = v
	}
	return out, s.Err()
}

// metricValue is the single sample of a metric without labels, 0 if absent.
func metricValue(ctx context.Context, n *Node, name string) (float64, error) {
	m, err := metricSamples(ctx, n, name)
	return m[""], err
}

// dropped returns n's weft_tunnel_dropped_packets_total by reason.
func dropped(ctx context.Context, n *Node) (map[string]float64, error) {
	m, err := metricSamples(ctx, n, "weft_tunnel_dropped_packets_total")
	if err != nil {
		return nil, err
	}
	out := map[string]float64{}
	for labels, v := range m {
		if r, ok := strings.CutPrefix(labels, `reason="`); ok {
			out[strings.TrimSuffix(r, `"`)] = v
		}
	}
	return out, nil
}

// grown lists the reasons whose count is higher in after than in before,
// with the difference.
func grown(before, after map[string]float64) map[string]float64 {
	out := map[string]float64{}
	for r, v := range after {
		if d := v - before[r]; d > 0 {
			out[r] = d
		}
	}
	return out
}

// logLines returns every line of n's router log that contains all parts.
func logLines(n *Node, parts ...string) []string {
	f, err := os.Open(n.RouterLog)
	if err != nil {
		return nil
	}
	defer f.Close()
	var out []string
	s := bufio.NewScanner(f)
	s.Buffer(make([]byte, 64<<10), 1<<20)
	for s.Scan() {
		line := s.Text()
		if !slices.ContainsFunc(parts, func(p string) bool { return !strings.Contains(line, p) }) {
			out = append(out, line)
		}
	}
	return out
}

// authLine is the mesh's warning about gossip with another or no password.
var authLine = regexp.MustCompile(`peer (\S+) failed authentication: wrong or missing password`)

// authFailureHosts counts n's auth-failure warnings by remote host (the
// address without its port: the rate limit is per host).
func authFailureHosts(n *Node) map[string]int {
	out := map[string]int{}
	for _, line := range logLines(n, "failed authentication") {
		m := authLine.FindStringSubmatch(line)
		if m == nil {
			continue
		}
		host := m[1]
		if ap, err := netip.ParseAddrPort(host); err == nil {
			host = ap.Addr().String()
		}
		out[host]++
	}
	return out
}

// watchNever calls bad every 500ms for d (or until ctx ends) in the
// background; wait blocks until then and returns the first complaint ("" if
// none) and how many polls ran. A test that ends early stops the watch.
func watchNever(t *testing.T, ctx context.Context, d time.Duration, bad func() string) (wait func() (string, int)) {
	var first string
	var polls int
	ctx, cancel := context.WithTimeout(ctx, d)
	done := make(chan struct{})
	go func() {
		defer close(done)
		tick := time.NewTicker(500 * time.Millisecond)
		defer tick.Stop()
		for {
			if s := bad(); s != "" && first == "" {
				first = s
			}
			polls++
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
		}
	}()
	t.Cleanup(func() {
		cancel()
		<-done
	})
	return func() (string, int) {
		<-done
		return first, polls
	}
}

// udpSink collects the datagrams a UDP socket in a pod receives.
type udpSink struct {
	conn *net.UDPConn
	ch   chan []byte
	done chan struct{}
}

// listenUDP opens a UDP socket on p's address and port and collects what
// arrives until the test ends.
func listenUDP(t *testing.T, p *Pod, port int) *udpSink {
	t.Helper()
	var conn *net.UDPConn
	if err := p.NS.Do(func() (err error) {
		conn, err = net.ListenUDP("udp4", net.UDPAddrFromAddrPort(netip.AddrPortFrom(p.IP, uint16(port))))
		return err
	}); err != nil {
		t.Fatalf("listening on UDP %d in %s: %v", port, p, err)
	}
	s := &udpSink{conn: conn, ch: make(chan []byte, 4096), done: make(chan struct{})}
	go func() {
		defer close(s.done)
		buf := make([]byte, 64<<10)
		for {
			n, err := conn.Read(buf)
			if err != nil {
				return // closed
			}
			select {
			case s.ch <- bytes.Clone(buf[:n]):
			default: // the test reads far less than this
			}
		}
	}()
	t.Cleanup(func() {
		conn.Close()
		<-s.done
	})
	return s
}

// next returns the next datagram, or false after d.
func (s *udpSink) next(d time.Duration) ([]byte, bool) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case b := <-s.ch:
		return b, true
	case <-t.C:
		return nil, false
	}
}

// waitSeq waits up to d for the marker datagram seq and reports whether
// it came; other datagrams are passed over.
func (s *udpSink) waitSeq(marker string, seq int, d time.Duration) bool {
	deadline := time.Now().Add(d)
	for {
		b, ok := s.next(time.Until(deadline))
		if !ok {
			return false
		}
		if markerSeq(b, marker) == seq {
			return true
		}
	}
}

// sendUDP sends one datagram from inside ns to dst.
func sendUDP(ns *Netns, dst netip.AddrPort, payload []byte) error {
	return ns.Do(func() error {
		c, err := net.DialUDP("udp4", nil, net.UDPAddrFromAddrPort(dst))
		if err != nil {
			return err
		}
		defer c.Close()
		_, err = c.Write(payload)
		return err
	})
}

// markerDatagram is datagram seq of a marker flow: the marker, the sequence
// number, padded to markerLen.
func markerDatagram(marker string, seq int) []byte {
	b := make([]byte, markerLen)
	copy(b, fmt.Sprintf("%s seq=%04d ", marker, seq))
	return b
}

// markerSeq returns the sequence number of a marker datagram, or -1.
func markerSeq(b []byte, marker string) int {
	rest, ok := bytes.CutPrefix(b, []byte(marker+" seq="))
	if !ok || len(rest) < 4 {
		return -1
	}
	n, err := strconv.Atoi(string(rest[:4]))
	if err != nil {
		return -1
	}
	return n
}

// sendMarkers sends count marker datagrams from pod from to the sink on
// pod to, one at a time: each is sent (again after 2s without it,
// at most three times) until the sink has it, so that every one leaves
// the sender's node in a frame of its own. It returns how often each
// sequence number arrived.
func sendMarkers(ctx context.Context, from *Pod, to netip.AddrPort, sink *udpSink, marker string, first, count int) (map[int]int, error) {
	got := map[int]int{}
	for seq := first; seq < first+count; seq++ {
		ok := false
		for try := 0; try < 3 && !ok; try++ {
			if err := sendUDP(from.NS, to, markerDatagram(marker, seq)); err != nil {
				return got, fmt.Errorf("sending marker %d from %s: %w", seq, from, err)
			}
			deadline := time.Now().Add(2 * time.Second)
			for !ok && time.Now().Before(deadline) {
				b, recv := sink.next(time.Until(deadline))
				if !recv {
					break
				}
				if s := markerSeq(b, marker); s >= 0 {
					got[s]++
					ok = s == seq
				}
			}
		}
		if !ok {
			return got, fmt.Errorf("marker datagram %d from %s never reached %s (3 tries)", seq, from, to)
		}
		if ctx.Err() != nil {
			return got, ctx.Err()
		}
	}
	return got, nil
}

// tcpMarker streams size bytes made of the marker repeated over TCP from
// pod from to pod to, and returns how many whole markers the receiver got.
func tcpMarker(ctx context.Context, from, to *Pod, marker string, size int) (int, error) {
	const port = 5202
	var ln net.Listener
	if err := to.NS.Do(func() (err error) {
		ln, err = net.Listen("tcp4", netip.AddrPortFrom(to.IP, port).String())
		return err
	}); err != nil {
		return 0, fmt.Errorf("listening in %s: %w", to, err)
	}
	defer ln.Close()
	type result struct {
		data []byte
		err  error
	}
	got := make(chan result, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			got <- result{err: err}
			return
		}
		defer c.Close()
		if dl, ok := ctx.Deadline(); ok {
			c.SetDeadline(dl)
		}
		data, err := io.ReadAll(c)
		got <- result{data, err}
	}()
	var c net.Conn
	if err := from.NS.Do(func() (err error) {
		d := net.Dialer{Timeout: 10 * time.Second}
		c, err = d.DialContext(ctx, "tcp4", netip.AddrPortFrom(to.IP, port).String())
		return err
	}); err != nil {
		return 0, fmt.Errorf("connecting from %s to %s: %w", from, to, err)
	}
	if dl, ok := ctx.Deadline(); ok {
		c.SetDeadline(dl)
	}
	unit := []byte(marker + "\n")
	stream := bytes.Repeat(unit, size/len(unit)+1)[:size]
	_, err := c.Write(stream)
	c.Close()
	if err != nil {
		return 0, fmt.Errorf("streaming from %s to %s: %w", from, to, err)
	}
	select {
	case r := <-got:
		if r.err != nil {
			return 0, fmt.Errorf("receiving in %s: %w", to, r.err)
		}
		if !bytes.Equal(r.data, stream) {
			return 0, fmt.Errorf("%s received %d bytes that differ from the %d sent", to, len(r.data), len(stream))
		}
		return bytes.Count(r.data, []byte(marker)), nil
	case <-ctx.Done():
		return 0, ctx.Err()
	}
}

// newMarker returns a marker string unique to this run.
func newMarker(kind string) string {
	b := make([]byte, 8)
	if _, err := rand.Read(b); err != nil {
		panic(err) // crypto/rand never fails on Linux
	}
	return "weft-" + kind + "-marker-" + hex.EncodeToString(b)
}

// capture records every frame an interface in a namespace sees, with an
// AF_PACKET socket in promiscuous mode (on a bridge, promiscuous mode is
// what makes the frames it forwards between its ports visible).
type capture struct {
	f    *os.File
	done chan struct{}

	mu    sync.Mutex // guards the fields below
	pkts  [][]byte
	bytes int
	trunc int // frames larger than the read buffer
	err   error
}

// captureLimit bounds the bytes a capture keeps.
const captureLimit = 64 << 20

// startCapture starts capturing on ifName inside ns. Frames are seen from
// the moment it returns.
func startCapture(ns *Netns, ifName string) (*capture, error) {
	const ethPAll = 0x0003 // ETH_P_ALL
	proto := int(htons(ethPAll))
	var fd int
	err := ns.Do(func() error {
		ifi, err := net.InterfaceByName(ifName)
		if err != nil {
			return err
		}
		fd, err = unix.Socket(unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, proto)
		if err != nil {
			return fmt.Errorf("AF_PACKET socket: %w", err)
		}
		fail := func(err error) error { unix.Close(fd); return err }
		if err := unix.Bind(fd, &unix.SockaddrLinklayer{Protocol: htons(ethPAll), Ifindex: ifi.Index}); err != nil {
			return fail(fmt.Errorf("binding to %s: %w", ifName, err))
		}
		mreq := &unix.PacketMreq{Ifindex: int32(ifi.Index), Type: unix.PACKET_MR_PROMISC}
		if err := unix.SetsockoptPacketMreq(fd, unix.SOL_PACKET, unix.PACKET_ADD_MEMBERSHIP, mreq); err != nil {
			return fail(fmt.Errorf("promiscuous mode on %s: %w", ifName, err))
		}
		_ = unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_RCVBUFFORCE, 8<<20)
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("capturing on %s in %s: %w", ifName, ns.Name, err)
	}
	c := &capture{f: os.NewFile(uintptr(fd), "capture "+ifName), done: make(chan struct{})}
	go c.routineRead()
	return c, nil
}

func htons(v uint16) uint16 { return v<<8 | v>>8 }

func (c *capture) routineRead() {
	defer close(c.done)
	buf := make([]byte, 256<<10)
	for {
		n, err := c.f.Read(buf)
		if err != nil {
			if !errors.Is(err, os.ErrClosed) {
				c.mu.Lock()
				c.err = err
				c.mu.Unlock()
			}
			return
		}
		c.mu.Lock()
		if n == len(buf) {
			c.trunc++
		}
		if c.bytes+n <= captureLimit {
			c.pkts = append(c.pkts, bytes.Clone(buf[:n]))
			c.bytes += n
		}
		c.mu.Unlock()
	}
}

// frames is what the capture has read so far. A frame is read a moment
// after it crossed the link (later on a busy machine): wait on frames for
// the frame a test needs before stop, which drops what is not read yet.
func (c *capture) frames() [][]byte {
	c.mu.Lock()
	defer c.mu.Unlock()
	return slices.Clone(c.pkts)
}

// stop ends the capture and returns the frames it saw.
func (c *capture) stop() ([][]byte, error) {
	c.f.Close()
	<-c.done
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.trunc > 0 && c.err == nil {
		c.err = fmt.Errorf("%d captured frames were larger than the read buffer", c.trunc)
	}
	return c.pkts, c.err
}

// udpDatagram is a UDP datagram seen on the wire.
type udpDatagram struct {
	Src, Dst netip.AddrPort
	Payload  []byte
}

// udpDatagrams picks the IPv4 UDP datagrams out of Ethernet frames.
func udpDatagrams(frames [][]byte) []udpDatagram {
	var out []udpDatagram
	for _, f := range frames {
		if len(f) < 14+20 || binary.BigEndian.Uint16(f[12:14]) != 0x0800 {
			continue
		}
		ip := f[14:]
		ihl := int(ip[0]&0x0f) * 4
		if ip[0]>>4 != 4 || ihl < 20 || len(ip) < ihl+8 || ip[9] != unix.IPPROTO_UDP {
			continue
		}
		if tot := int(binary.BigEndian.Uint16(ip[2:4])); tot >= ihl+8 && tot <= len(ip) {
			ip = ip[:tot]
		}
		if binary.BigEndian.Uint16(ip[6:8])&0x1fff != 0 {
			continue // a later fragment
		}
		src := netip.AddrFrom4([4]byte(ip[12:16]))
		dst := netip.AddrFrom4([4]byte(ip[16:20]))
		udp := ip[ihl:]
		out = append(out, udpDatagram{
			Src:     netip.AddrPortFrom(src, binary.BigEndian.Uint16(udp[0:2])),
			Dst:     netip.AddrPortFrom(dst, binary.BigEndian.Uint16(udp[2:4])),
			Payload: udp[8:],
		})
	}
	return out
}

// dataFrames are the captured weft data frames (UDP to the data port) from
// node a to node b.
func dataFrames(dgs []udpDatagram, a, b *Node) []udpDatagram {
	var out []udpDatagram
	for _, d := range dgs {
		if d.Src.Addr() == a.UnderlayIP && d.Dst == netip.AddrPortFrom(b.UnderlayIP, dataPort) && len(d.Payload) >= frameHeaderLen {
			out = append(out, d)
		}
	}
	return out
}

// ipv4UDP builds an IPv4 packet (with its header checksum) carrying a UDP
// datagram without a checksum.
func ipv4UDP(src, dst netip.AddrPort, payload []byte) []byte {
	b := make([]byte, 28+len(payload))
	b[0] = 0x45
	binary.BigEndian.PutUint16(b[2:4], uint16(len(b)))
	binary.BigEndian.PutUint16(b[6:8], 0x4000) // DF
	b[8] = 64
	b[9] = unix.IPPROTO_UDP
	s, d := src.Addr().As4(), dst.Addr().As4()
	copy(b[12:16], s[:])
	copy(b[16:20], d[:])
	var sum uint32
	for i := 0; i < 20; i += 2 {
		sum += uint32(binary.BigEndian.Uint16(b[i : i+2]))
	}
	for sum > 0xffff {
		sum = sum&0xffff + sum>>16
	}
	binary.BigEndian.PutUint16(b[10:12], ^uint16(sum))
	binary.BigEndian.PutUint16(b[20:22], src.Port())
	binary.BigEndian.PutUint16(b[22:24], dst.Port())
	binary.BigEndian.PutUint16(b[24:26], uint16(8+len(payload)))
	copy(b[28:], payload)
	return b
}

// weftFrame is a udp data frame: the 16-byte header and the payload.
func weftFrame(flags byte, keyID uint32, counter uint64, payload []byte) []byte {
	b := make([]byte, frameHeaderLen+len(payload))
	b[0], b[1], b[2] = 1, 1, flags // version 1, type data
	binary.BigEndian.PutUint32(b[4:8], keyID)
	binary.BigEndian.PutUint64(b[8:16], counter)
	copy(b[frameHeaderLen:], payload)
	return b
}

// sendRaw sends an IPv4 packet as is, its source address included, from a
// raw socket inside ns.
func sendRaw(ns *Netns, pkt []byte) error {
	return ns.Do(func() error {
		fd, err := unix.Socket(unix.AF_INET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.IPPROTO_RAW)
		if err != nil {
			return fmt.Errorf("raw socket: %w", err)
		}
		defer unix.Close(fd)
		return unix.Sendto(fd, pkt, 0, &unix.SockaddrInet4{Addr: [4]byte(pkt[16:20])})
	})
}

// connectionFields returns, per line of `weft status connections` that
// names peer, its whitespace-separated fields.
func connectionFields(out []byte, peer string) [][]string {
	var res [][]string
	for line := range strings.Lines(string(out)) {
		if strings.Contains(line, peer) {
			res = append(res, strings.Fields(line))
		}
	}
	return res
}

// checkConnections checks that `weft status connections` on n shows every
// node of others established with the given protection (encrypted,
// unencrypted or trusted) and returns the output.
func checkConnections(t *testing.T, ctx context.Context, n *Node, others []*Node, protection string) {
	t.Helper()
	waitUntil(t, ctx, n.Name+"'s connections "+protection, func() (bool, string) {
		out, err := n.Weft(ctx, "status", "connections")
		if err != nil {
			return false, err.Error()
		}
		for _, o := range others {
			lines := connectionFields(out, o.PeerName)
			if len(lines) != 1 || !slices.Contains(lines[0], "established") || !slices.Contains(lines[0], protection) {
				return false, string(out)
			}
		}
		return true, ""
	})
}

// TestSecurityIntruder: three nodes share a password, a fourth has another.
// The fourth never joins (not in any peer list, it sees no one), the three
// log one clear, rate-limited line about it and count the failures, pods
// on two of them talk encrypted, and frames that the fourth sends to a pod,
// with its own address or spoofing a member's, are dropped and counted.
func TestSecurityIntruder(t *testing.T) {
	start := time.Now()
	good := writePassword(t, "good", "correct horse battery staple 7c1e")
	bad := writePassword(t, "bad", "not the cluster's password at all")
	c, ctx := startSecCluster(t, 4, 3, func(n *Node) []string {
		if n.Index == 3 {
			return []string{"--encap", "udp", "--password-file", bad}
		}
		return []string{"--encap", "udp", "--password-file", good, "--ipalloc-init", "consensus=3"}
	})
	members, intruder := c.Nodes[:3], c.Nodes[3]
	t.Logf("three members ready after %v", time.Since(start).Round(time.Millisecond))
	// The password is never logged; the options line says it is there.
	for _, n := range c.Nodes {
		data, err := os.ReadFile(n.RouterLog)
		if err != nil {
			t.Fatal(err)
		}
		if strings.Contains(string(data), "correct horse") || strings.Contains(string(data), "not the cluster's password") {
			t.Fatalf("%s's log shows a password", n.Name)
		}
		if !strings.Contains(string(data), "password:<redacted>") {
			t.Errorf("%s's options line does not say a password is set", n.Name)
		}
	}

	// Watch, for the whole test and at least 12s, that the intruder shows up
	// in no member's peer list and sees no one itself.
	wait := watchNever(t, ctx, 12*time.Second, func() string {
		for _, n := range members {
			st := peerStates(ctx, n)
			if _, in := st[intruder.PeerName]; in || st["error"] != "" {
				return fmt.Sprintf("%s's peers: %v", n.Name, st)
			}
		}
		st := peerStates(ctx, intruder)
		if len(st) > 1 || (len(st) == 1 && st[intruder.PeerName] == "") {
			return fmt.Sprintf("the intruder's peers: %v", st)
		}
		return ""
	})

	for _, n := range members {
		text, err := n.HTTPGet(ctx, "/status")
		if err != nil || !strings.Contains(string(text), "Peers: 3\n") {
			t.Fatalf("%s /status:\n%s (%v)", n.Name, text, err)
		}
		out, err := n.Weft(ctx, "status")
		if err != nil || !regexp.MustCompile(`(?m)^\s*Encryption: enabled$`).Match(out) {
			t.Fatalf("%s weft status:\n%s (%v)", n.Name, out, err)
		}
		var others []*Node
		for _, o := range members {
			if o != n {
				others = append(others, o)
			}
		}
		checkConnections(t, ctx, n, others, "encrypted")
	}

	// Every member logs the clear line about the intruder's address and
	// counts failures; so does the intruder about the members.
	waitUntil(t, ctx, "the auth-failure line and metric on every node", func() (bool, string) {
		var seen []string
		ok := true
		for _, n := range c.Nodes {
			hosts := authFailureHosts(n)
			v, err := metricValue(ctx, n, "weft_mesh_auth_failures_total")
			seen = append(seen, fmt.Sprintf("%s: lines %v, metric %v (%v)", n.Name, hosts, v, err))
			if n == intruder {
				ok = ok && len(hosts) > 0 && v > 0
			} else {
				ok = ok && hosts[intruder.UnderlayIP.String()] > 0 && v > 0
			}
		}
		return ok, strings.Join(seen, "; ")
	})

	// Pods on two members talk (encrypted: every path is).
	a, err := members[0].AddPod(ctx, "a")
	if err != nil {
		t.Fatal(err)
	}
	b, err := members[1].AddPod(ctx, "b")
	if err != nil {
		t.Fatal(err)
	}
	if err := Ping(ctx, a.NS, b.IP); err != nil {
		t.Fatalf("%v\n%s", err, routerLogs(c))
	}
	if err := Ping(ctx, b.NS, a.IP); err != nil {
		t.Fatalf("%v\n%s", err, routerLogs(c))
	}

	// The intruder sends frames at pod a: with its own address (no peer
	// of n0) and spoofing n2's (a member, whose frames must be sealed).
	const podPort = 7002
	sink := listenUDP(t, a, podPort)
	n0, n2 := members[0], members[2]
	target := netip.AddrPortFrom(n0.UnderlayIP, dataPort)
	inner := ipv4UDP(netip.AddrPortFrom(b.IP, 40000), netip.AddrPortFrom(a.IP, podPort), []byte(newMarker("intruder")))
	garbage := make([]byte, 120)
	if _, err := rand.Read(garbage); err != nil {
		t.Fatal(err)
	}
	plain := weftFrame(0, 0, 1, inner)
	sealed := weftFrame(flagEncrypted, 0x5eed1e55, 1, garbage)
	spoofed := netip.AddrPortFrom(n2.UnderlayIP, dataPort)
	before, err := dropped(ctx, n0)
	if err != nil {
		t.Fatal(err)
	}
	for range 3 {
		for _, f := range [][]byte{plain, sealed} {
			if err := sendUDP(intruder.NS, target, f); err != nil {
				t.Fatal(err)
			}
			if err := sendRaw(intruder.NS, ipv4UDP(spoofed, target, f)); err != nil {
				t.Fatalf("spoofing %s from %s: %v", spoofed, intruder.Name, err)
			}
		}
	}
	// Each kind of frame is dropped and counted: from no peer as
	// unknown-peer (3 plaintext + 3 sealed), a member's plaintext as
	// plaintext, a member's garbage as auth.
	want := map[string]float64{"unknown-peer": 6, "plaintext": 3, "auth": 3}
	var diff map[string]float64
	waitUntil(t, ctx, "n0 counting the intruder's frames as dropped", func() (bool, string) {
		after, err := dropped(ctx, n0)
		if err != nil {
			return false, err.Error()
		}
		diff = grown(before, after)
		for r, v := range want {
			if diff[r] < v {
				return false, fmt.Sprintf("grown: %v, want at least %v", diff, want)
			}
		}
		return true, ""
	})
	t.Logf("n0 dropped the intruder's 12 frames; counters grown: %v", diff)
	if got, ok := sink.next(2 * time.Second); ok {
		t.Fatalf("pod %s received an intruder's datagram: %q", a, got)
	}
	// The sink works: a datagram from pod b arrives.
	if _, err := sendMarkers(ctx, b, netip.AddrPortFrom(a.IP, podPort), sink, newMarker("control"), 0, 1); err != nil {
		t.Fatal(err)
	}

	if seen, polls := wait(); seen != "" {
		t.Fatalf("the intruder was seen in the mesh: %s", seen)
	} else {
		t.Logf("the intruder in no peer list over %d polls", polls)
	}
	if lines := logLines(n0, "failed authentication"); len(lines) > 0 {
		t.Logf("n0 logs: %s", lines[0])
	}
	// Rate-limited: at most a couple of lines per remote host, however many
	// failures were counted.
	for _, n := range c.Nodes {
		hosts := authFailureHosts(n)
		v, _ := metricValue(ctx, n, "weft_mesh_auth_failures_total")
		for h, k := range hosts {
			if k > 2 {
				t.Errorf("%s logged %d auth-failure lines about %s within %v: not rate-limited\n%s", n.Name, k, h, time.Since(start).Round(time.Second), strings.Join(logLines(n, "failed authentication"), "\n"))
			}
		}
		t.Logf("%s: auth-failure lines by host %v, weft_mesh_auth_failures_total %v", n.Name, hosts, v)
	}
	t.Logf("done in %v", time.Since(start).Round(time.Millisecond))
}

// markerRun is a marker flow between a pod on n0 and one on n1 of a
// two-node cluster, and what a capture of the underlay bridge saw of it.
type markerRun struct {
	c        *Cluster
	ctx      context.Context
	from, to *Pod
	sink     *udpSink
	dst      netip.AddrPort
	marker   string
	sent     int
	dgs      []udpDatagram
}

// runMarker starts a two-node cluster with args, and sends marker
// datagrams and a marker TCP stream from a pod on n0 to one on n1 while
// capturing the underlay bridge. The receiving pod must get every marker,
// and the capture must have seen the data frames.
func runMarker(t *testing.T, args ...string) *markerRun {
	t.Helper()
	start := time.Now()
	c, ctx := startSecCluster(t, 2, 2, func(*Node) []string { return args })
	r := &markerRun{c: c, ctx: ctx, marker: newMarker("wire"), sent: 20}
	var err error
	if r.from, err = c.Nodes[0].AddPod(ctx, "a"); err != nil {
		t.Fatal(err)
	}
	if r.to, err = c.Nodes[1].AddPod(ctx, "b"); err != nil {
		t.Fatal(err)
	}
	if err := Ping(ctx, r.from.NS, r.to.IP); err != nil {
		t.Fatalf("%v\n%s", err, routerLogs(c))
	}
	t.Logf("cluster and pods ready after %v", time.Since(start).Round(time.Millisecond))
	const port = 7001
	r.sink = listenUDP(t, r.to, port)
	r.dst = netip.AddrPortFrom(r.to.IP, port)

	cp, err := startCapture(c.Underlay, underlayBridge)
	if err != nil {
		t.Fatal(err)
	}
	got, err := sendMarkers(ctx, r.from, r.dst, r.sink, r.marker, 0, r.sent)
	if err != nil {
		cp.stop()
		t.Fatalf("%v\n%s", err, routerLogs(c))
	}
	const streamSize = 256 << 10
	n, err := tcpMarker(ctx, r.from, r.to, r.marker, streamSize)
	frames, cerr := cp.stop()
	if err != nil {
		t.Fatalf("%v\n%s", err, routerLogs(c))
	}
	if cerr != nil {
		t.Fatal(cerr)
	}
	t.Logf("%s received %d marker datagrams (%v) and a %d-byte TCP stream holding %d markers", r.to, len(got), got, streamSize, n)
	r.dgs = udpDatagrams(frames)
	data := dataFrames(r.dgs, c.Nodes[0], c.Nodes[1])
	if len(data) < r.sent {
		t.Fatalf("the capture saw %d data frames from n0 to %s (of %d frames, %d UDP): it did not really run", len(data), netip.AddrPortFrom(c.Nodes[1].UnderlayIP, dataPort), len(frames), len(r.dgs))
	}
	t.Logf("captured %d frames on %s, %d UDP datagrams, %d data frames from n0 to n1", len(frames), underlayBridge, len(r.dgs), len(data))
	return r
}

// markerFrames counts the captured datagrams whose payload holds the marker.
func (r *markerRun) markerFrames() int {
	n := 0
	for _, d := range r.dgs {
		if bytes.Contains(d.Payload, []byte(r.marker)) {
			n++
		}
	}
	return n
}

// TestSecurityMarkerOnTheWire: a marker sent from a pod on one node to a
// pod on another, in UDP datagrams and a TCP stream, arrives in both cases,
// and is in a capture of the underlay without a password and absent with
// one, where every data frame is sealed. With the password, a captured
// frame sent again (from the sender's address, so that it is taken as the
// sender's and authenticates) is dropped as a replay and a tampered one as
// auth, and neither reaches the pod.
func TestSecurityMarkerOnTheWire(t *testing.T) {
	t.Run("plaintext", func(t *testing.T) {
		r := runMarker(t, "--encap", "udp")
		if n := r.markerFrames(); n == 0 {
			t.Fatalf("no captured datagram holds the marker %q without a password", r.marker)
		} else {
			t.Logf("without a password, %d captured datagrams hold the marker", n)
		}
		for _, d := range dataFrames(r.dgs, r.c.Nodes[0], r.c.Nodes[1]) {
			if d.Payload[2]&flagEncrypted != 0 {
				t.Fatalf("a sealed frame without a password: % x", d.Payload[:frameHeaderLen])
			}
		}
		out, err := r.c.Nodes[0].Weft(r.ctx, "status")
		if err != nil || !regexp.MustCompile(`(?m)^\s*Encryption: disabled$`).Match(out) {
			t.Fatalf("n0 weft status:\n%s (%v)", out, err)
		}
		// A control for the intruder test: a frame built as the intruder
		// builds them, sent from a member of this cluster without a
		// password, is delivered; so the intruder's frames are dropped for
		// where they come from, not for how they are made.
		n0, n1 := r.c.Nodes[0], r.c.Nodes[1]
		inner := ipv4UDP(netip.AddrPortFrom(r.from.IP, 40000), r.dst, markerDatagram(r.marker, r.sent))
		if err := sendUDP(n0.NS, netip.AddrPortFrom(n1.UnderlayIP, dataPort), weftFrame(0, 0, 1, inner)); err != nil {
			t.Fatal(err)
		}
		if b, ok := r.sink.next(5 * time.Second); !ok || markerSeq(b, r.marker) != r.sent {
			t.Fatalf("a hand-made plaintext frame from n0 did not reach %s (got %q, %v)", r.to, b, ok)
		}
	})
	t.Run("encrypted", func(t *testing.T) {
		pw := writePassword(t, "pw", "a shared secret for the marker test")
		r := runMarker(t, "--encap", "udp", "--password-file", pw)
		checkConnections(t, r.ctx, r.c.Nodes[0], r.c.Nodes[1:], "encrypted")
		if n := r.markerFrames(); n != 0 {
			t.Fatalf("%d captured datagrams hold the marker %q with a password", n, r.marker)
		}
		data := dataFrames(r.dgs, r.c.Nodes[0], r.c.Nodes[1])
		for _, d := range data {
			if d.Payload[2]&flagEncrypted == 0 {
				t.Fatalf("a plaintext frame with a password: % x", d.Payload[:frameHeaderLen])
			}
		}
		t.Logf("with a password, none of %d captured datagrams holds the marker; all %d data frames n0->n1 are sealed", len(r.dgs), len(data))

		t.Run("replay", func(t *testing.T) { testReplay(t, r) })
	})
}

// testReplay sends one marker datagram while capturing the underlay, then
// sends its captured sealed frame again, and a tampered copy, from n0's
// underlay address to n1's data port.
func testReplay(t *testing.T, r *markerRun) {
	ctx := r.ctx
	n0, n1 := r.c.Nodes[0], r.c.Nodes[1]
	const seq = 9000 // far from the sequence numbers sent before
	cp, err := startCapture(r.c.Underlay, underlayBridge)
	if err != nil {
		t.Fatal(err)
	}
	if err := sendUDP(r.from.NS, r.dst, markerDatagram(r.marker, seq)); err != nil {
		cp.stop()
		t.Fatal(err)
	}
	arrived := r.sink.waitSeq(r.marker, seq, 5*time.Second)
	if !arrived {
		cp.stop()
		t.Fatalf("marker datagram %d never reached %s\n%s", seq, r.to, routerLogs(r.c))
	}
	// Its frame: header, IPv4 and UDP headers, the datagram, the tag; the
	// only one of that size in this capture. It crossed the bridge before
	// it arrived, but the capture may not have read it yet.
	size := frameHeaderLen + 28 + markerLen + aeadTagLen
	sealedIn := func(frames [][]byte) [][]byte {
		var sealed [][]byte
		for _, d := range dataFrames(udpDatagrams(frames), n0, n1) {
			if len(d.Payload) == size {
				sealed = append(sealed, d.Payload)
			}
		}
		return sealed
	}
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	WaitUntil(t, wctx, "the capture to read the sealed marker frame", func() (bool, string) {
		n := len(sealedIn(cp.frames()))
		return n > 0, fmt.Sprintf("%d frames of %d bytes read", n, size)
	})
	cancel()
	frames, err := cp.stop()
	if err != nil {
		t.Fatal(err)
	}
	sealed := sealedIn(frames)
	if len(sealed) != 1 {
		t.Fatalf("the capture holds %d data frames n0->n1 of %d bytes (a sealed marker datagram), want 1", len(sealed), size)
	}
	frame := sealed[0]
	t.Logf("replaying the %d-byte frame of datagram %d: key id %d, counter %d", len(frame), seq,
		binary.BigEndian.Uint32(frame[4:8]), binary.BigEndian.Uint64(frame[8:16]))

	// The receiver knows the sender by its IP address only (tunnel/forward.go:
	// byAddr[m.Addr.Addr()]), so any socket in n0's namespace will do.
	target := netip.AddrPortFrom(n1.UnderlayIP, dataPort)
	tampered := bytes.Clone(frame)
	tampered[frameHeaderLen+10] ^= 0x01
	before, err := dropped(ctx, n1)
	if err != nil {
		t.Fatal(err)
	}
	for range 3 {
		if err := sendUDP(n0.NS, target, frame); err != nil {
			t.Fatal(err)
		}
	}
	if err := sendUDP(n0.NS, target, tampered); err != nil {
		t.Fatal(err)
	}
	var diff map[string]float64
	waitUntil(t, ctx, "n1 counting the replays and the tampered frame", func() (bool, string) {
		after, err := dropped(ctx, n1)
		if err != nil {
			return false, err.Error()
		}
		diff = grown(before, after)
		return diff["replay"] >= 3 && diff["auth"] >= 1, fmt.Sprintf("grown: %v", diff)
	})
	t.Logf("n1's drop counters grew by %v", diff)
	if r.sink.waitSeq(r.marker, seq, 2*time.Second) {
		t.Fatalf("pod %s received datagram %d a second time: the replay was delivered", r.to, seq)
	}
	// The path still works: a fresh datagram arrives.
	if err := sendUDP(r.from.NS, r.dst, markerDatagram(r.marker, seq+1)); err != nil {
		t.Fatal(err)
	}
	if !r.sink.waitSeq(r.marker, seq+1, 5*time.Second) {
		t.Fatalf("after the replay, a fresh datagram %d did not reach %s", seq+1, r.to)
	}
}

// TestSecurityTrustedSubnets: with a password and the underlay in
// --trusted-subnets, data between members travels in plaintext on purpose
// (the marker is on the wire and connections say trusted), while the
// gossip still refuses a node with another password.
func TestSecurityTrustedSubnets(t *testing.T) {
	good := writePassword(t, "good", "trusted subnets still need this")
	bad := writePassword(t, "bad", "an intruder inside the subnet")
	trusted := UnderlaySubnet.String()
	c, ctx := startSecCluster(t, 3, 2, func(n *Node) []string {
		pw := good
		if n.Index == 2 {
			pw = bad
		}
		return []string{"--encap", "udp", "--password-file", pw, "--trusted-subnets", trusted, "--ipalloc-init", "consensus=2"}
	})
	members, intruder := c.Nodes[:2], c.Nodes[2]
	for i, n := range members {
		checkConnections(t, ctx, n, []*Node{members[1-i]}, "trusted")
		out, err := n.Weft(ctx, "status")
		if err != nil || !regexp.MustCompile(`(?m)^\s*Encryption: enabled$`).Match(out) {
			t.Fatalf("%s weft status:\n%s (%v)", n.Name, out, err)
		}
	}
	waitUntil(t, ctx, "both members refusing the intruder's gossip", func() (bool, string) {
		var seen []string
		ok := true
		for _, n := range members {
			v, err := metricValue(ctx, n, "weft_mesh_auth_failures_total")
			hosts := authFailureHosts(n)
			seen = append(seen, fmt.Sprintf("%s: metric %v (%v), lines %v", n.Name, v, err, hosts))
			ok = ok && v > 0 && hosts[intruder.UnderlayIP.String()] > 0
		}
		return ok, strings.Join(seen, "; ")
	})

	a, err := members[0].AddPod(ctx, "a")
	if err != nil {
		t.Fatal(err)
	}
	b, err := members[1].AddPod(ctx, "b")
	if err != nil {
		t.Fatal(err)
	}
	if err := Ping(ctx, a.NS, b.IP); err != nil {
		t.Fatalf("%v\n%s", err, routerLogs(c))
	}
	sink := listenUDP(t, b, 7001)
	marker := newMarker("trusted")
	cp, err := startCapture(c.Underlay, underlayBridge)
	if err != nil {
		t.Fatal(err)
	}
	_, err = sendMarkers(ctx, a, netip.AddrPortFrom(b.IP, 7001), sink, marker, 0, 5)
	frames, cerr := cp.stop()
	if err != nil {
		t.Fatalf("%v\n%s", err, routerLogs(c))
	}
	if cerr != nil {
		t.Fatal(cerr)
	}
	dgs := udpDatagrams(frames)
	seen := 0
	for _, d := range dataFrames(dgs, members[0], members[1]) {
		if bytes.Contains(d.Payload, []byte(marker)) {
			seen++
			if d.Payload[2]&flagEncrypted != 0 {
				t.Fatalf("a sealed frame holds the marker in plaintext?! % x", d.Payload[:frameHeaderLen])
			}
		}
	}
	if seen < 5 {
		t.Fatalf("%d plaintext data frames from n0 to n1 hold the marker, want 5 (captured %d frames, %d UDP)", seen, len(frames), len(dgs))
	}
	for _, n := range members {
		if st := peerStates(ctx, n); st[intruder.PeerName] != "" || st["error"] != "" {
			t.Fatalf("%s's peers include the intruder: %v", n.Name, st)
		}
	}
	t.Logf("trusted subnet: %d plaintext frames with the marker on the wire; the intruder still refused", seen)
}
