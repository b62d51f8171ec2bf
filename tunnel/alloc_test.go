package tunnel

import (
	"context"
	"errors"
	"net/netip"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/weft-net/weft/tunnel/conn"
	"github.com/weft-net/weft/tunnel/crypt"
	"github.com/weft-net/weft/tunnel/tun"
)

// TestNoAllocationPerPacket pushes batches through both directions of a
// Device over seams that allocate nothing themselves, and counts the
// allocations: the packet path must make none per packet.
func TestNoAllocationPerPacket(t *testing.T) {
	const batches = 400
	out := ipv4Packet("10.32.0.5", "10.36.0.7", 1000, true)
	in := frame(dataHeader, ipv4Packet("10.36.0.7", "10.32.0.5", 1000, true))
	fwd := frame(dataHeader, ipv4Packet("10.36.0.7", "10.40.0.5", 1000, true))
	tn := &staticTUN{pkt: out, left: batches, done: make(chan struct{})}
	b := &staticBind{frames: [][]byte{in, fwd}, from: netip.AddrPortFrom(underlayOf("b"), DefaultDataPort), left: batches, done: make(chan struct{})}
	d, err := New(Config{Self: "a", Mode: ModeUDP, MTU: 1440, TUN: tn, UDP: b})
	if err != nil {
		t.Fatal(err)
	}
	peers := []Peer{{Name: "b", Underlay: underlayOf("b"), DataPort: DefaultDataPort}, {Name: "c", Underlay: underlayOf("c"), DataPort: DefaultDataPort}}
	if err := d.SetPeers(peers); err != nil {
		t.Fatal(err)
	}
	if err := d.SetRing(ring, gatewayOf("a")); err != nil {
		t.Fatal(err)
	}
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	ctx, cancel := context.WithCancel(context.Background())
	runErr := make(chan error)
	go func() { runErr <- d.Run(ctx) }()
	<-tn.done
	<-b.done
	runtime.ReadMemStats(&after)
	cancel()
	if err := <-runErr; err != nil {
		t.Fatal(err)
	}
	// Out: every packet read from the TUN device; in: half of the frames
	// received are for a, the other half forwarded to c.
	const perDir = batches * tun.DefaultBatchSize
	if got := b.sent.Load(); got != perDir+perDir/2 {
		t.Fatalf("%d packets sent, want %d", got, perDir+perDir/2)
	}
	if got := tn.written.Load(); got != perDir/2 {
		t.Fatalf("%d packets written to the TUN device, want %d", got, perDir/2)
	}
	packets := uint64(2 * perDir)
	mallocs := after.Mallocs - before.Mallocs
	t.Logf("%d allocations for %d packets", mallocs, packets)
	if mallocs > packets/100 {
		t.Errorf("%d allocations for %d packets: the packet path allocates", mallocs, packets)
	}
}

// TestNoAllocationPerPacketEncrypted is TestNoAllocationPerPacket with
// encryption on: packets from the TUN device are sealed for c; sealed
// frames from b (trusted, but it seals all the same) are opened and
// written to the TUN device, plaintext frames from b for c's range are
// sealed and forwarded to c (copied first: the datagram has no room for
// the tag). What reaches c opens with c's keys.
func TestNoAllocationPerPacketEncrypted(t *testing.T) {
	const batches = 400
	now := time.Date(2026, 11, 30, 12, 0, 0, 0, time.UTC)
	kb, _ := crypt.GenerateKeyPair()
	kc, _ := crypt.GenerateKeyPair()
	ka, _ := crypt.GenerateKeyPair()
	lb := crypt.NewLocal(kb, [crypt.KeySize]byte(pskOne), crypt.Limits{})
	lc := crypt.NewLocal(kc, [crypt.KeySize]byte(pskOne), crypt.Limits{})
	ba, _ := lb.Session(ka.Public())
	ca, _ := lc.Session(ka.Public())
	bPath := &peerPath{sess: ba}
	in := ipv4Packet("10.36.0.7", "10.32.0.5", 1000, true)
	fwd := frame(dataHeader, ipv4Packet("10.36.0.7", "10.40.0.5", 1000, true))
	var sc crypt.Scratch
	gen := func(i int, buf []byte) []byte {
		if i%2 == 1 {
			return buf[:copy(buf, fwd)]
		}
		copy(buf[FrameHeaderLen:], in)
		f, _ := sealFrame(buf[:FrameHeaderLen+len(in)], 0, bPath, &sc, now)
		return f
	}
	var mu sync.Mutex
	var toC [][]byte
	capture := func(m conn.Message) {
		mu.Lock()
		defer mu.Unlock()
		if len(toC) < 4 {
			toC = append(toC, append([]byte(nil), m.Data...))
		}
	}
	tn := &staticTUN{pkt: ipv4Packet("10.32.0.5", "10.40.0.7", 1000, true), left: batches, done: make(chan struct{})}
	b := &staticBind{gen: gen, capture: capture, from: netip.AddrPortFrom(underlayOf("b"), DefaultDataPort), left: batches, done: make(chan struct{})}
	d, err := New(Config{Self: "a", Mode: ModeUDP, MTU: 1440, TUN: tn, UDP: b, PSK: pskOne, KeyPair: ka,
		TrustedSubnets: []netip.Prefix{netip.PrefixFrom(underlayOf("b"), 32)}, Now: func() time.Time { return now }})
	if err != nil {
		t.Fatal(err)
	}
	kbPub, kcPub := kb.Public(), kc.Public()
	peers := []Peer{
		{Name: "b", Underlay: underlayOf("b"), DataPort: DefaultDataPort, PublicKey: kbPub[:]},
		{Name: "c", Underlay: underlayOf("c"), DataPort: DefaultDataPort, PublicKey: kcPub[:]},
	}
	if err := d.SetPeers(peers); err != nil {
		t.Fatal(err)
	}
	if err := d.SetRing(ring, gatewayOf("a")); err != nil {
		t.Fatal(err)
	}
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	ctx, cancel := context.WithCancel(context.Background())
	runErr := make(chan error)
	go func() { runErr <- d.Run(ctx) }()
	<-tn.done
	<-b.done
	runtime.ReadMemStats(&after)
	cancel()
	if err := <-runErr; err != nil {
		t.Fatal(err)
	}
	const perDir = batches * tun.DefaultBatchSize
	if got := b.sent.Load(); got != perDir+perDir/2 {
		t.Fatalf("%d packets sent, want %d (drops: auth %v replay %v plaintext %v no-key %v)", got, perDir+perDir/2,
			dropped(d, dropAuth), dropped(d, dropReplay), dropped(d, dropPlaintext), dropped(d, dropNoKey))
	}
	if got := tn.written.Load(); got != perDir/2 {
		t.Fatalf("%d packets written to the TUN device, want %d", got, perDir/2)
	}
	packets := uint64(2 * perDir)
	mallocs := after.Mallocs - before.Mallocs
	t.Logf("%d allocations for %d packets", mallocs, packets)
	if mallocs > packets/100 {
		t.Errorf("%d allocations for %d packets: the packet path allocates", mallocs, packets)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(toC) == 0 {
		t.Fatal("nothing captured")
	}
	for _, f := range toC {
		h, err := DecodeFrameHeader(f)
		if !errors.Is(err, ErrEncrypted) || !sealed(f) {
			t.Fatalf("frame to c not sealed: %+v", h)
		}
		if _, err := ca.Open(&sc, h.KeyID, h.Counter, f[:FrameHeaderLen], f[FrameHeaderLen:], now); err != nil {
			t.Errorf("c cannot open a frame (forwarded %v): %v", h.Flags&FlagForwarded != 0, err)
		}
	}
}

// staticTUN returns the same packet in full batches, left times, then
// blocks until closed.
type staticTUN struct {
	pkt     []byte
	left    int
	done    chan struct{}
	closed  sync.Once
	stop    chan struct{}
	written atomic.Int64
	mu      sync.Mutex
}

func (s *staticTUN) Name() string        { return "static" }
func (s *staticTUN) MTU() int            { return 1440 }
func (s *staticTUN) BatchSize() int      { return tun.DefaultBatchSize }
func (s *staticTUN) Queues() []tun.Queue { return []tun.Queue{s} }
func (s *staticTUN) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.stop == nil {
		s.stop = make(chan struct{})
	}
	s.closed.Do(func() { close(s.stop) })
	return nil
}

func (s *staticTUN) stopCh() chan struct{} {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.stop == nil {
		s.stop = make(chan struct{})
	}
	return s.stop
}

func (s *staticTUN) Read(bufs [][]byte, sizes []int, offset int) (int, error) {
	if s.left == 0 {
		close(s.done)
		s.left = -1
	}
	if s.left < 0 {
		<-s.stopCh()
		return 0, tun.ErrClosed
	}
	s.left--
	for i := range bufs {
		sizes[i] = copy(bufs[i][offset:], s.pkt)
	}
	return len(bufs), nil
}

func (s *staticTUN) Write(bufs [][]byte, offset int) (int, error) {
	s.written.Add(int64(len(bufs)))
	return len(bufs), nil
}

// staticBind receives full batches of its frames in turn, left times,
// from one address; it discards what is sent. With gen, it makes frame i
// of each batch by gen in a buffer of 2048 bytes instead; with capture,
// it shows what is sent to it first.
type staticBind struct {
	frames  [][]byte
	gen     func(i int, buf []byte) []byte
	capture func(conn.Message)
	bufs    [][]byte
	from    netip.AddrPort
	left    int
	done    chan struct{}
	sent    atomic.Uint64
	stop    chan struct{}
	once    sync.Once
	mu      sync.Mutex
}

func (b *staticBind) Recv(msgs []conn.Message) (int, error) {
	if b.left == 0 {
		close(b.done)
		b.left = -1
	}
	if b.left < 0 {
		<-b.stopCh()
		return 0, conn.ErrClosed
	}
	b.left--
	if b.bufs == nil {
		for range msgs {
			b.bufs = append(b.bufs, make([]byte, 2048))
		}
	}
	for i := range msgs {
		var buf []byte
		if b.gen != nil {
			buf = b.gen(i, b.bufs[i])
			buf = buf[:len(buf):len(buf)] // no room behind the datagram, as in a GRO buffer
		} else {
			f := b.frames[i%len(b.frames)]
			buf = b.bufs[i][:len(f):len(f)]
			copy(buf, f)
		}
		msgs[i] = conn.Message{Buf: buf, Data: buf, Addr: b.from}
	}
	return len(msgs), nil
}

func (b *staticBind) Send(msgs []conn.Message) (int, error) {
	if b.capture != nil {
		for _, m := range msgs {
			b.capture(m)
		}
	}
	b.sent.Add(uint64(len(msgs)))
	return len(msgs), nil
}

func (b *staticBind) stopCh() chan struct{} {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.stop == nil {
		b.stop = make(chan struct{})
	}
	return b.stop
}

func (b *staticBind) BatchSize() int    { return tun.DefaultBatchSize }
func (b *staticBind) LocalPort() uint16 { return DefaultDataPort }
func (b *staticBind) Close() error {
	ch := b.stopCh()
	b.once.Do(func() { close(ch) })
	return nil
}
