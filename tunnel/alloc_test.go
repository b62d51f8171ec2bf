package tunnel

import (
	"context"
	"net/netip"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/weft-net/weft/tunnel/conn"
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
// from one address; it discards what is sent.
type staticBind struct {
	frames [][]byte
	bufs   [][]byte
	from   netip.AddrPort
	left   int
	done   chan struct{}
	sent   atomic.Uint64
	stop   chan struct{}
	once   sync.Once
	mu     sync.Mutex
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
		f := b.frames[i%len(b.frames)]
		buf := b.bufs[i][:len(f):len(f)]
		copy(buf, f)
		msgs[i] = conn.Message{Buf: buf, Data: buf, Addr: b.from}
	}
	return len(msgs), nil
}

func (b *staticBind) Send(msgs []conn.Message) (int, error) {
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
