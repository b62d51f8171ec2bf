package conn

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"syscall"
	"unsafe"

	"golang.org/x/net/ipv4"
	"golang.org/x/sys/unix"
)

// DefaultBatchSize is how many datagrams one Recv or Send moves.
const DefaultBatchSize = 128

const (
	// socketBuffer is the send and receive buffer asked for, so that a
	// burst of batches is not dropped while the other side is busy.
	socketBuffer = 8 << 20
	// maxUDPPayload is the most a UDP datagram (or a GSO send) carries.
	maxUDPPayload = 65535 - 20 - 8
	// maxGSOSegments is the most segments one GSO send may have (the
	// kernel's UDP_MAX_SEGMENTS on older kernels).
	maxGSOSegments = 64
	// groBuffers is how many 64 KiB buffers a UDP bind with GRO reads
	// into per recvmmsg.
	groBuffers = 16
)

// UDPOptions tunes the UDP bind.
type UDPOptions struct {
	// MaxDatagram is the largest datagram expected; larger ones are
	// received truncated where GRO is off. 0 means 64 KiB.
	MaxDatagram int
	// MaxSegment is the largest datagram that fits the underlay path
	// (its MTU minus the IP and UDP headers); larger ones are sent alone
	// rather than in a GSO send. 0 means MaxDatagram.
	MaxSegment int
	// NoOffload turns UDP segmentation (GSO) and receive offload (GRO)
	// off: one system call moves many datagrams all the same, but the
	// kernel handles each on its own.
	NoOffload bool
}

// ListenUDP opens the UDP data socket on addr (e.g. 0.0.0.0:6784) in the
// calling thread's network namespace. Where the kernel allows, runs of
// equal-sized datagrams to one peer leave as one GSO send (UDP_SEGMENT)
// and arrive as one GRO buffer (UDP_GRO).
func ListenUDP(addr netip.AddrPort, o UDPOptions) (*UDPBind, error) {
	if !addr.Addr().Is4() {
		return nil, fmt.Errorf("data address %s: weft's underlay is IPv4: give an IPv4 address (or 0.0.0.0)", addr)
	}
	if o.MaxDatagram <= 0 || o.MaxDatagram > maxUDPPayload {
		o.MaxDatagram = maxUDPPayload
	}
	if o.MaxSegment <= 0 || o.MaxSegment > o.MaxDatagram {
		o.MaxSegment = o.MaxDatagram
	}
	c, err := net.ListenUDP("udp4", net.UDPAddrFromAddrPort(addr))
	if err != nil {
		return nil, fmt.Errorf("listening for encapsulated data on udp %s: %w", addr, err)
	}
	if err := setBuffers(c); err != nil {
		c.Close()
		return nil, fmt.Errorf("udp %s: %w", addr, err)
	}
	b := &UDPBind{c: c, port: uint16(c.LocalAddr().(*net.UDPAddr).Port)}
	gro := false
	if !o.NoOffload {
		b.gso.Store(true)
		gro = setsockopt(c, unix.IPPROTO_UDP, unix.UDP_GRO, 1) == nil
	}
	b.init(ipv4.NewPacketConn(c), false, gro, o.MaxDatagram)
	b.maxSeg = o.MaxSegment
	return b, nil
}

// ListenIPIP opens a raw socket of IP protocol 4 (IPIP) in the calling
// thread's network namespace: the userspace IPIP used where the kernel has
// no ipip link type. It needs CAP_NET_RAW. maxDatagram is the largest
// outer packet expected (the underlay MTU); 0 means 64 KiB.
func ListenIPIP(maxDatagram int) (*IPIPBind, error) {
	if maxDatagram <= 0 || maxDatagram > 65535 {
		maxDatagram = 65535
	}
	c, err := net.ListenIP("ip4:4", &net.IPAddr{IP: net.IPv4zero})
	if err != nil {
		return nil, fmt.Errorf("opening a raw IPIP socket (protocol 4): %w", err)
	}
	if err := setBuffers(c); err != nil {
		c.Close()
		return nil, fmt.Errorf("raw IPIP socket: %w", err)
	}
	b := &IPIPBind{c: c}
	b.init(ipv4.NewPacketConn(c), true, false, maxDatagram)
	return b, nil
}

func setsockopt(c syscall.Conn, level, opt, value int) error {
	rc, err := c.SyscallConn()
	if err != nil {
		return err
	}
	var serr error
	if err := rc.Control(func(fd uintptr) { serr = unix.SetsockoptInt(int(fd), level, opt, value) }); err != nil {
		return err
	}
	return serr
}

// setBuffers asks for large socket buffers, beyond rmem_max where the
// process may (CAP_NET_ADMIN), else as large as allowed.
func setBuffers(c syscall.Conn) error {
	for _, o := range [][2]int{{unix.SO_RCVBUFFORCE, unix.SO_RCVBUF}, {unix.SO_SNDBUFFORCE, unix.SO_SNDBUF}} {
		if setsockopt(c, unix.SOL_SOCKET, o[0], socketBuffer) != nil {
			if err := setsockopt(c, unix.SOL_SOCKET, o[1], socketBuffer); err != nil {
				return fmt.Errorf("setting socket buffers: %w", err)
			}
		}
	}
	return nil
}

// batcher does the batched I/O that the UDP and IPIP binds share.
type batcher struct {
	pc     *ipv4.PacketConn
	ipip   bool
	gro    bool        // receive: the kernel may join datagrams (UDP_GRO)
	gso    atomic.Bool // send: join runs into one UDP_SEGMENT send
	maxSeg int         // the largest datagram that joins a GSO send

	// The receive side, used by one goroutine at a time. A recvmmsg
	// fills rms; Recv hands out its datagrams (with GRO, the segments
	// of each buffer) over as many calls as it takes.
	rmu   sync.Mutex
	rms   []ipv4.Message
	rbufs [][]byte
	roobs [][]byte
	rn    int // messages in rms from the last recvmmsg
	ri    int // the message being handed out
	roff  int // where its next segment starts

	sendPool sync.Pool // of *sendScratch
}

// sendScratch is the state of one Send, reused through a pool so that a
// Send allocates nothing.
type sendScratch struct {
	ms    []ipv4.Message // one per GSO run or lone datagram
	iov   [][]byte       // the runs' buffers, one per datagram
	first []int          // the first datagram of each message
	udp   []net.UDPAddr
	ip    []net.IPAddr
	addrs [][4]byte
	oob   [][]byte // UDP_SEGMENT control messages
}

// markOOB is the IP_TOS control message that sets the outer header's
// DSCP to MarkDSCP on a raw IPIP send.
var markOOB = func() []byte {
	b := make([]byte, unix.CmsgSpace(4))
	h := (*unix.Cmsghdr)(unsafe.Pointer(&b[0]))
	h.Level, h.Type = unix.IPPROTO_IP, unix.IP_TOS
	h.SetLen(unix.CmsgLen(4))
	binary.NativeEndian.PutUint32(b[unix.CmsgLen(0):], MarkDSCP<<2)
	return b
}()

func (b *batcher) init(pc *ipv4.PacketConn, ipip, gro bool, maxDatagram int) {
	b.pc, b.ipip, b.gro = pc, ipip, gro
	n, size := DefaultBatchSize, maxDatagram
	if gro {
		n, size = groBuffers, 65535
	}
	b.maxSeg = maxDatagram
	b.rms = make([]ipv4.Message, n)
	b.rbufs = make([][]byte, n)
	b.roobs = make([][]byte, n)
	slab := make([]byte, n*size)
	for i := range b.rms {
		b.rbufs[i] = slab[i*size : (i+1)*size : (i+1)*size]
		b.rms[i].Buffers = b.rbufs[i : i+1]
		if gro {
			b.roobs[i] = make([]byte, unix.CmsgSpace(4))
		}
	}
	b.sendPool.New = func() any {
		s := &sendScratch{
			ms:    make([]ipv4.Message, DefaultBatchSize),
			iov:   make([][]byte, DefaultBatchSize),
			first: make([]int, DefaultBatchSize+1),
			udp:   make([]net.UDPAddr, DefaultBatchSize),
			ip:    make([]net.IPAddr, DefaultBatchSize),
			addrs: make([][4]byte, DefaultBatchSize),
			oob:   make([][]byte, DefaultBatchSize),
		}
		for i := range s.ms {
			s.oob[i] = make([]byte, unix.CmsgSpace(2))
			if ipip {
				s.ip[i].IP = s.addrs[i][:]
				s.ms[i].Addr = &s.ip[i]
			} else {
				s.udp[i].IP = s.addrs[i][:]
				s.ms[i].Addr = &s.udp[i]
			}
		}
		return s
	}
}

func (b *batcher) recv(msgs []Message) (int, error) {
	b.rmu.Lock()
	defer b.rmu.Unlock()
	out := 0
	for out < len(msgs) {
		if b.ri >= b.rn {
			if out > 0 {
				return out, nil // do not wait for more
			}
			if err := b.readBatch(); err != nil {
				return 0, err
			}
			continue
		}
		rm := &b.rms[b.ri]
		buf := b.rbufs[b.ri][:rm.N:rm.N]
		if b.ipip {
			m := &msgs[out]
			b.ri++
			var ok bool
			if m.Addr, m.Data, m.Mark, ok = parseIPIP(buf); ok {
				m.Buf = buf
				out++
			}
			continue
		}
		seg := len(buf)
		if b.gro {
			seg = groSize(b.roobs[b.ri][:rm.NN], seg)
		}
		end := min(b.roff+seg, len(buf))
		frame := buf[b.roff:end:end]
		b.roff = end
		if b.roff >= len(buf) {
			b.ri, b.roff = b.ri+1, 0
		}
		ua, _ := rm.Addr.(*net.UDPAddr)
		if ua == nil || len(frame) == 0 {
			continue
		}
		ip, _ := netip.AddrFromSlice(ua.IP)
		msgs[out] = Message{Buf: frame, Data: frame, Addr: netip.AddrPortFrom(ip.Unmap(), uint16(ua.Port))}
		out++
	}
	return out, nil
}

// readBatch waits for datagrams and reads as many as are there.
func (b *batcher) readBatch() error {
	for i := range b.rms {
		b.rms[i].N, b.rms[i].NN, b.rms[i].Addr = 0, 0, nil
		if b.gro {
			b.rms[i].OOB = b.roobs[i]
		}
	}
	n, err := b.pc.ReadBatch(b.rms, 0)
	if err != nil {
		b.rn, b.ri = 0, 0
		if errors.Is(err, net.ErrClosed) {
			return ErrClosed
		}
		return fmt.Errorf("receiving encapsulated data: %w", err)
	}
	b.rn, b.ri, b.roff = n, 0, 0
	return nil
}

// groSize reads the segment size of a GRO buffer from its control
// messages (UDP_GRO); def when there is none.
func groSize(oob []byte, def int) int {
	for len(oob) >= unix.CmsgLen(0) {
		h := (*unix.Cmsghdr)(unsafe.Pointer(&oob[0]))
		l := int(h.Len)
		if l < unix.CmsgLen(0) || l > len(oob) {
			break
		}
		if h.Level == unix.IPPROTO_UDP && h.Type == unix.UDP_GRO && l >= unix.CmsgLen(2) {
			v := int(binary.NativeEndian.Uint16(oob[unix.CmsgLen(0):]))
			if l >= unix.CmsgLen(4) {
				v = int(binary.NativeEndian.Uint32(oob[unix.CmsgLen(0):]))
			}
			if v > 0 {
				return v
			}
		}
		oob = oob[min(unix.CmsgSpace(l-unix.CmsgLen(0)), len(oob)):]
	}
	return def
}

// parseIPIP takes the outer IPv4 header off a datagram read from the raw
// socket (the kernel has checked its checksum and length).
func parseIPIP(p []byte) (src netip.AddrPort, inner []byte, mark, ok bool) {
	if len(p) < 20 || p[0]>>4 != 4 || p[9] != 4 {
		return src, nil, false, false
	}
	ihl := int(p[0]&0x0f) * 4
	total := int(binary.BigEndian.Uint16(p[2:4]))
	if ihl < 20 || total < ihl || total > len(p) {
		return src, nil, false, false
	}
	src = netip.AddrPortFrom(netip.AddrFrom4([4]byte(p[12:16])), 0)
	return src, p[ihl:total], p[1]>>2 == MarkDSCP, true
}

// send sends msgs; runs of datagrams to one address with one size (the
// last may be shorter) go as one GSO send each.
func (b *batcher) send(msgs []Message) (int, error) {
	s := b.sendPool.Get().(*sendScratch)
	defer b.sendPool.Put(s)
	sent := 0
	var first error
	for len(msgs) > 0 {
		g := b.pack(s, msgs[:min(len(msgs), len(s.iov))])
		n, err := b.pc.WriteBatch(s.ms[:g], 0)
		for i := range g {
			s.ms[i].Buffers = nil
		}
		clear(s.iov)
		done := s.first[n]
		sent += done
		msgs = msgs[done:]
		if err == nil {
			continue
		}
		if errors.Is(err, net.ErrClosed) {
			return sent, ErrClosed
		}
		run := s.first[n+1] - s.first[n]
		if run > 1 && (errors.Is(err, unix.EIO) || errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOPROTOOPT)) && b.gso.Load() {
			b.gso.Store(false) // the kernel or the device cannot segment: send them one by one
			continue
		}
		if first == nil {
			first = fmt.Errorf("sending encapsulated data to %s: %w", msgs[0].Addr, err)
		}
		msgs = msgs[run:] // skip what the kernel refused
	}
	return sent, first
}

// pack fills s with messages for the start of msgs and returns how many;
// s.first[i] is the index in msgs of message i's first datagram, and
// s.first[g] how many datagrams the g messages carry.
func (b *batcher) pack(s *sendScratch, msgs []Message) int {
	gso := !b.ipip && b.gso.Load()
	i, g := 0, 0
	for i < len(msgs) && g < len(s.ms) {
		start := i
		size := len(msgs[i].Data)
		total := size
		i++
		if gso && size <= b.maxSeg {
			for i < len(msgs) && i-start < maxGSOSegments && msgs[i].Addr == msgs[start].Addr {
				l := len(msgs[i].Data)
				if l > size || total+l > maxUDPPayload {
					break
				}
				total += l
				i++
				if l < size {
					break // only the last may be shorter
				}
			}
		}
		for j := start; j < i; j++ {
			s.iov[j] = msgs[j].Data
		}
		m := &s.ms[g]
		m.Buffers = s.iov[start:i]
		m.OOB = nil
		s.addrs[g] = msgs[start].Addr.Addr().As4()
		switch {
		case b.ipip:
			if msgs[start].Mark {
				m.OOB = markOOB
			}
		default:
			s.udp[g].Port = int(msgs[start].Addr.Port())
			if i-start > 1 {
				m.OOB = segmentOOB(s.oob[g], size)
			}
		}
		s.first[g] = start
		g++
	}
	s.first[g] = i
	return g
}

// segmentOOB writes the UDP_SEGMENT control message for segments of size
// bytes into b.
func segmentOOB(b []byte, size int) []byte {
	h := (*unix.Cmsghdr)(unsafe.Pointer(&b[0]))
	h.Level, h.Type = unix.IPPROTO_UDP, unix.UDP_SEGMENT
	h.SetLen(unix.CmsgLen(2))
	binary.NativeEndian.PutUint16(b[unix.CmsgLen(0):], uint16(size))
	return b[:unix.CmsgSpace(2)]
}

// UDPBind is the UDP data socket.
type UDPBind struct {
	batcher
	c    *net.UDPConn
	port uint16
}

// Recv implements Bind.
func (b *UDPBind) Recv(msgs []Message) (int, error) { return b.recv(msgs) }

// Send implements Bind.
func (b *UDPBind) Send(msgs []Message) (int, error) { return b.send(msgs) }

// BatchSize implements Bind.
func (b *UDPBind) BatchSize() int { return DefaultBatchSize }

// LocalPort implements Bind.
func (b *UDPBind) LocalPort() uint16 { return b.port }

// Offload reports whether GSO sends and GRO receives are on.
func (b *UDPBind) Offload() (gso, gro bool) { return b.gso.Load(), b.gro }

// Close implements Bind.
func (b *UDPBind) Close() error { return b.c.Close() }

// IPIPBind is the raw IPIP socket.
type IPIPBind struct {
	batcher
	c *net.IPConn
}

// Recv implements Bind.
func (b *IPIPBind) Recv(msgs []Message) (int, error) { return b.recv(msgs) }

// Send implements Bind.
func (b *IPIPBind) Send(msgs []Message) (int, error) { return b.send(msgs) }

// BatchSize implements Bind.
func (b *IPIPBind) BatchSize() int { return DefaultBatchSize }

// LocalPort implements Bind.
func (b *IPIPBind) LocalPort() uint16 { return 0 }

// Close implements Bind.
func (b *IPIPBind) Close() error { return b.c.Close() }
