package tunnel

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"
)

// ARP, as the probes use it (RFC 826; the probe form of RFC 5227).
const (
	etherTypeARP = 0x0806
	arpLen       = 28 // htype 2, ptype 2, hlen 1, plen 1, op 2, sha 6, spa 4, tha 6, tpa 4
	arpRequest   = 1
	arpReply     = 2
)

// ARPProber is the kernel's PathProber: an AF_PACKET socket on the VXLAN
// device that sends ARP probes to the peers' VTEPs and reads the answers.
// Where this node's kernel does not answer its peers' probes itself
// (arp_ignore above 0: it answers only for addresses on the device the
// request came in by, and the underlay address is not on the VXLAN
// device), the prober answers them, so that its peers see the path as
// it is; those answers stop while the router is down. arp_ignore is read
// again at most every arpIgnoreEvery, when a peer's probe comes in, so
// that a change made while the router runs (an IPVS setup of kube-proxy
// starting later) costs a peer at most one or two unanswered probes, not
// a fall to udp.
type ARPProber struct {
	f      *os.File
	ifidx  int
	mac    [6]byte // this node's VTEP MAC
	self   netip.Addr
	answer atomic.Bool // answer the peers' probes in userspace

	// OnAnswerChange, if set before Run, is called (on Run's goroutine)
	// when a new reading of arp_ignore changes whether the prober
	// answers.
	OnAnswerChange func(answers bool, arpIgnore int)

	// csum is the checksum probes' socket (csumprobe.go): AF_PACKET for
	// IPv4 on the same device, with a virtio-net header in front of every
	// frame and a filter that passes only UDP to ChecksumProbePort; nil
	// where it could not be opened (CsumErr says why).
	csum      *os.File
	closeCsum func() error // closes csum once: Run and Close may both
	CsumErr   error

	mu      sync.Mutex
	buf     []byte
	closed  bool
	checked time.Time // when arp_ignore was last read (Run's goroutine)
	now     func() time.Time
	readArp func() int
	// sysctls are all's and dev's arp_ignore, opened in the device's
	// namespace: /proc/sys/net opened later would be the namespace of
	// whichever thread opens it.
	sysctls []*os.File
}

// arpIgnoreEvery is how often, at most, the prober reads arp_ignore again.
const arpIgnoreEvery = time.Second

// NewARPProber opens the prober on the device of index ifidx, whose MAC
// is mac, in the calling thread's network namespace; self is this node's
// VTEP address (what peers probe for).
func NewARPProber(ifidx int, dev string, mac [6]byte, self netip.Addr) (*ARPProber, error) {
	fd, err := unix.Socket(unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_CLOEXEC|unix.SOCK_NONBLOCK, int(htons(etherTypeARP)))
	if err != nil {
		return nil, fmt.Errorf("opening the vxlan path prober (an AF_PACKET socket needs CAP_NET_RAW): %w", err)
	}
	if err := unix.Bind(fd, &unix.SockaddrLinklayer{Protocol: htons(etherTypeARP), Ifindex: ifidx}); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("binding the vxlan path prober to %s: %w", dev, err)
	}
	p := &ARPProber{f: os.NewFile(uintptr(fd), "arp-probe:"+dev), ifidx: ifidx, mac: mac, self: self, now: time.Now}
	for _, c := range []string{"all", dev} {
		if f, err := os.Open("/proc/sys/net/ipv4/conf/" + c + "/arp_ignore"); err == nil {
			p.sysctls = append(p.sysctls, f)
		}
	}
	p.readArp = func() int { return arpIgnore(p.sysctls) }
	p.csum, p.CsumErr = openCsumSocket(ifidx, dev, self)
	if p.csum != nil {
		p.closeCsum = sync.OnceValue(p.csum.Close)
	}
	p.answer.Store(p.readArp() > 0)
	p.checked = time.Now()
	return p, nil
}

// AnswersItself reports whether the prober answers the peers' probes
// (the kernel does not: arp_ignore).
func (p *ARPProber) AnswersItself() bool { return p.answer.Load() }

// refreshAnswer reads arp_ignore again if arpIgnoreEvery has passed since
// the last reading, and says so if that changes whether the prober
// answers.
func (p *ARPProber) refreshAnswer() {
	now := p.now()
	if now.Sub(p.checked) < arpIgnoreEvery && !now.Before(p.checked) {
		return
	}
	p.checked = now
	v := p.readArp()
	if was := p.answer.Swap(v > 0); was != (v > 0) && p.OnAnswerChange != nil {
		p.OnAnswerChange(v > 0, v)
	}
}

// arpIgnore is the kernel's arp_ignore for a device: the larger of all's
// and the device's (ip-sysctl.rst), read from their open files. An
// unreadable value counts as 0.
func arpIgnore(files []*os.File) int {
	v := 0
	var b [16]byte
	for _, f := range files {
		n, err := f.ReadAt(b[:], 0)
		if n == 0 && err != nil {
			continue
		}
		if x, err := strconv.Atoi(strings.TrimSpace(string(b[:n]))); err == nil {
			v = max(v, x)
		}
	}
	return v
}

func htons(v uint16) uint16 { return v<<8 | v>>8 }

// appendARP appends an ARP frame (Ethernet header and ARP) to b.
func appendARP(b []byte, dst, src [6]byte, op uint16, sha [6]byte, spa netip.Addr, tha [6]byte, tpa netip.Addr) []byte {
	b = append(b, dst[:]...)
	b = append(b, src[:]...)
	b = binary.BigEndian.AppendUint16(b, etherTypeARP)
	b = append(b, 0, 1, 8, 0, 6, 4) // Ethernet, IPv4
	b = binary.BigEndian.AppendUint16(b, op)
	b = append(b, sha[:]...)
	spa4, tpa4 := spa.As4(), tpa.As4()
	b = append(b, spa4[:]...)
	b = append(b, tha[:]...)
	return append(b, tpa4[:]...)
}

// Probe sends an ARP probe (sender address 0.0.0.0) for e's VTEP address
// to e's MAC, padded with zeros to size bytes.
func (p *ARPProber) Probe(e VTEPEntry, size int) error {
	if !e.Addr.Is4() {
		return fmt.Errorf("probing %s: not an IPv4 VTEP", e.Addr)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return os.ErrClosed
	}
	b := appendARP(p.buf[:0], e.MAC, p.mac, arpRequest, p.mac, netip.IPv4Unspecified(), [6]byte{}, e.Addr)
	for len(b) < size {
		b = append(b, 0)
	}
	p.buf = b
	return sendFrame(p.f, b, etherTypeARP, p.ifidx, e.MAC)
}

// sendFrame sends frame b (of ethertype proto) on f, a packet socket of
// the device ifidx, to MAC to.
func sendFrame(f *os.File, b []byte, proto uint16, ifidx int, to [6]byte) error {
	rc, err := f.SyscallConn()
	if err != nil {
		return err
	}
	sa := &unix.SockaddrLinklayer{Protocol: htons(proto), Ifindex: ifidx, Halen: 6}
	copy(sa.Addr[:], to[:])
	var serr error
	err = rc.Write(func(fd uintptr) bool {
		serr = unix.Sendto(int(fd), b, 0, sa)
		return serr != unix.EAGAIN
	})
	return errors.Join(err, serr)
}

// Run reads ARP frames until Close: answers to this node's probes go to
// answered; the peers' probes of this node are answered here if the
// kernel does not. With the checksum socket it reads that too: the peers'
// checksum probes are checked and answered, the answers to this node's go
// to verdict.
func (p *ARPProber) Run(answered func(mac [6]byte, addr netip.Addr), verdict func(mac [6]byte, nonce uint64, good bool)) error {
	if p.csum == nil {
		return p.runARP(answered)
	}
	errc := make(chan error, 1)
	go func() { errc <- p.runCsum(verdict) }()
	err := p.runARP(answered)
	if err != nil {
		// Whatever ended the ARP reader ends the checksum one too.
		p.closeCsum()
	}
	return errors.Join(err, <-errc)
}

// runARP reads the ARP socket until Close.
func (p *ARPProber) runARP(answered func(mac [6]byte, addr netip.Addr)) error {
	return readFrames(p.f, func(b []byte) { p.handle(b, answered) })
}

// readFrames reads the frames that come in on packet socket f (not this
// node's own going out) and hands each to handle, until f is closed.
func readFrames(f *os.File, handle func(b []byte)) error {
	rc, err := f.SyscallConn()
	if err != nil {
		return err
	}
	buf := make([]byte, 2048)
	for {
		var n int
		var from unix.Sockaddr
		var rerr error
		err := rc.Read(func(fd uintptr) bool {
			n, from, rerr = unix.Recvfrom(int(fd), buf, 0)
			return rerr != unix.EAGAIN
		})
		if err != nil {
			if errors.Is(err, os.ErrClosed) {
				return nil
			}
			return err
		}
		if rerr != nil {
			return rerr
		}
		if ll, ok := from.(*unix.SockaddrLinklayer); ok && ll.Pkttype == unix.PACKET_OUTGOING {
			continue
		}
		handle(buf[:n])
	}
}

// handle reads one frame; anything that is not a well-formed ARP probe or
// answer of the VXLAN paths is ignored. It never panics.
func (p *ARPProber) handle(b []byte, answered func(mac [6]byte, addr netip.Addr)) {
	if len(b) < EthernetHeaderLen+arpLen || binary.BigEndian.Uint16(b[12:14]) != etherTypeARP {
		return
	}
	a := b[EthernetHeaderLen:]
	if binary.BigEndian.Uint16(a[0:2]) != 1 || binary.BigEndian.Uint16(a[2:4]) != 0x0800 || a[4] != 6 || a[5] != 4 {
		return
	}
	op := binary.BigEndian.Uint16(a[6:8])
	sha, spa := [6]byte(a[8:14]), netip.AddrFrom4([4]byte(a[14:18]))
	tha, tpa := [6]byte(a[18:24]), netip.AddrFrom4([4]byte(a[24:28]))
	switch {
	case op == arpReply && tha == p.mac && [6]byte(b[0:6]) == p.mac:
		answered(sha, spa)
	case op == arpRequest && spa.IsUnspecified() && tpa == p.self && sha != p.mac:
		if p.refreshAnswer(); !p.AnswersItself() {
			return
		}
		reply := appendARP(nil, sha, p.mac, arpReply, p.mac, p.self, sha, netip.IPv4Unspecified())
		p.mu.Lock()
		defer p.mu.Unlock()
		if !p.closed {
			_ = sendFrame(p.f, reply, etherTypeARP, p.ifidx, sha) // a lost answer is a lost probe
		}
	}
}

// Close closes the sockets, which ends Run.
func (p *ARPProber) Close() error {
	p.mu.Lock()
	p.closed = true
	p.mu.Unlock()
	for _, f := range p.sysctls {
		f.Close()
	}
	err := p.f.Close()
	if p.csum != nil {
		err = errors.Join(err, p.closeCsum())
	}
	return err
}

// virtio-net header flags (include/uapi/linux/virtio_net.h).
const (
	vnetNeedsCsum = 1 // VIRTIO_NET_HDR_F_NEEDS_CSUM: the device is to complete the checksum
	vnetDataValid = 2 // VIRTIO_NET_HDR_F_DATA_VALID: the device (or the kernel) checked it
	vnetHdrLen    = 10
)

// csumFilter is a classic BPF program for the checksum socket: IPv4 UDP,
// not a fragment, to this node's underlay address self and port
// ChecksumProbePort. Probes and answers go between the nodes' underlay
// addresses, which no pod's packet is routed to through the VXLAN device,
// so a pod cannot reach the socket; every pod packet the device receives
// is left alone at the cost of a few instructions.
func csumFilter(self netip.Addr) []unix.SockFilter {
	return []unix.SockFilter{
		{Code: 0x30, K: 23},                     // ldb [23]: the IP protocol
		{Code: 0x15, Jt: 0, Jf: 8, K: protoUDP}, // jeq UDP, else drop
		{Code: 0x28, K: 20},                     // ldh [20]: flags and fragment offset
		{Code: 0x45, Jt: 6, Jf: 0, K: 0x1fff},   // jset offset: drop
		{Code: 0x20, K: 30},                     // ld [30]: the IP destination
		{Code: 0x15, Jt: 0, Jf: 4, K: binary.BigEndian.Uint32(self.AsSlice())}, // jeq self, else drop
		{Code: 0xb1, K: EthernetHeaderLen},                                     // ldx 4*([14]&0xf): the IP header length
		{Code: 0x48, K: EthernetHeaderLen + 2},                                 // ldh [x+16]: the UDP destination port
		{Code: 0x15, Jt: 0, Jf: 1, K: ChecksumProbePort},                       // jeq the probe port, else drop
		{Code: 0x06, K: 0x40000},                                               // ret: take it
		{Code: 0x06, K: 0},                                                     // ret: drop
	}
}

// openCsumSocket opens the checksum probes' socket on the device. The
// filter is attached before the socket is bound to a protocol, so that
// no other frame is ever queued on it.
func openCsumSocket(ifidx int, dev string, self netip.Addr) (*os.File, error) {
	if !self.Is4() {
		return nil, fmt.Errorf("vxlan checksum prober: %s is no IPv4 address", self)
	}
	fd, err := unix.Socket(unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_CLOEXEC|unix.SOCK_NONBLOCK, 0)
	if err != nil {
		return nil, fmt.Errorf("opening the vxlan checksum prober: %w", err)
	}
	filter := csumFilter(self)
	prog := unix.SockFprog{Len: uint16(len(filter)), Filter: &filter[0]}
	for _, step := range []struct {
		what string
		do   func() error
	}{
		{"attaching its filter", func() error { return unix.SetsockoptSockFprog(fd, unix.SOL_SOCKET, unix.SO_ATTACH_FILTER, &prog) }},
		{"asking for virtio-net headers", func() error { return unix.SetsockoptInt(fd, unix.SOL_PACKET, unix.PACKET_VNET_HDR, 1) }},
		{"binding it to " + dev, func() error {
			return unix.Bind(fd, &unix.SockaddrLinklayer{Protocol: htons(unix.ETH_P_IP), Ifindex: ifidx})
		}},
	} {
		if err := step.do(); err != nil {
			unix.Close(fd)
			return nil, fmt.Errorf("vxlan checksum prober: %s: %w", step.what, err)
		}
	}
	return os.NewFile(uintptr(fd), "csum-probe:"+dev), nil
}

// ProbeChecksum sends the two checksum probes of a round from this
// node's underlay address to e's: with nonce (odd), its UDP checksum left
// to the device; with nonce-1, the control, without a checksum. Without
// the checksum socket it does nothing.
func (p *ARPProber) ProbeChecksum(e VTEPEntry, nonce uint64) error {
	if p.csum == nil {
		return nil
	}
	if !e.Addr.Is4() {
		return fmt.Errorf("checksum probe of %s: not IPv4", e.Addr)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return os.ErrClosed
	}
	var h [vnetHdrLen]byte
	h[0] = vnetNeedsCsum
	binary.NativeEndian.PutUint16(h[6:], csumStart)
	binary.NativeEndian.PutUint16(h[8:], csumOffset)
	b := appendCsumFrame(append(p.buf[:0], h[:]...), e.MAC, p.mac, p.self, e.Addr, csumKindProbe, nonce|1, false)
	err := sendFrame(p.csum, b, unix.ETH_P_IP, p.ifidx, e.MAC)
	b = appendCsumFrame(append(b[:0], make([]byte, vnetHdrLen)...), e.MAC, p.mac, p.self, e.Addr, csumKindControl, nonce&^1, false)
	p.buf = b
	return errors.Join(err, sendFrame(p.csum, b, unix.ETH_P_IP, p.ifidx, e.MAC))
}

// runCsum reads the checksum socket until Close: a peer's probe is
// checked and answered; an answer to this node's probe goes to verdict.
func (p *ARPProber) runCsum(verdict func(mac [6]byte, nonce uint64, good bool)) error {
	return readFrames(p.csum, func(b []byte) {
		if len(b) >= vnetHdrLen {
			p.handleCsum(b[0], b[vnetHdrLen:], verdict)
		}
	})
}

// handleCsum reads one frame (vnetFlags from its virtio-net header);
// anything that is not a well-formed probe to this node or an answer to
// it is ignored. It never panics.
func (p *ARPProber) handleCsum(vnetFlags byte, b []byte, verdict func(mac [6]byte, nonce uint64, good bool)) {
	f, ok := parseCsumFrame(b)
	if !ok || f.dstMAC != p.mac || f.srcMAC == p.mac || f.dst != p.self {
		return
	}
	if f.kind == csumKindGood || f.kind == csumKindBad {
		verdict(f.srcMAC, f.nonce, f.kind == csumKindGood)
		return
	}
	// As the kernel would take it: a checksum still to be completed (a
	// frame that crossed only virtual links) or one the device checked
	// is good; otherwise the sum must add up. The control has none.
	kind := byte(csumKindBad)
	if f.kind == csumKindControl || vnetFlags&(vnetNeedsCsum|vnetDataValid) != 0 || f.sumOK {
		kind = csumKindGood
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return
	}
	var h [vnetHdrLen]byte
	b = appendCsumFrame(h[:], f.srcMAC, p.mac, p.self, f.src, kind, f.nonce, false)
	_ = sendFrame(p.csum, b, unix.ETH_P_IP, p.ifidx, f.srcMAC) // a lost answer is a lost probe
}
