package meshtest

import (
	"math/rand/v2"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/memberlist"
)

// Lossy wraps any memberlist transport (a meshtest Transport or a real
// NetTransport): it loses each outgoing packet with probability Loss,
// delays each kept one by Delay, and counts the bytes sent, packets and
// streams alike, with the largest packet and the largest stream (one
// stream is one push-pull or join exchange). Streams are never lost (TCP
// retransmits) nor delayed.
type Lossy struct {
	memberlist.NodeAwareTransport

	rngMu sync.Mutex
	rng   *rand.Rand // guarded by rngMu
	loss  atomic.Uint64
	delay atomic.Int64 // time.Duration of each packet's delivery

	packetsSent, packetsLost, bytesSent atomic.Uint64
	maxPacket, maxStream                atomic.Uint64

	streams chan net.Conn
	done    chan struct{}
	wg      sync.WaitGroup
	once    sync.Once
}

// NewLossy wraps inner, losing packets with probability loss (0 to 1),
// drawn from a generator seeded with seed so that a run can be replayed.
func NewLossy(inner memberlist.NodeAwareTransport, loss float64, seed uint64) *Lossy {
	l := &Lossy{
		NodeAwareTransport: inner,
		rng:                rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15)),
		streams:            make(chan net.Conn),
		done:               make(chan struct{}),
	}
	l.SetLoss(loss)
	l.wg.Add(1)
	go l.routineStreams()
	return l
}

// SetLoss changes the loss probability.
func (l *Lossy) SetLoss(p float64) { l.loss.Store(uint64(p * 1e9)) }

// SetDelay delays the delivery of every packet sent from now on by d (0:
// none), as a network's one-way latency would.
func (l *Lossy) SetDelay(d time.Duration) { l.delay.Store(int64(d)) }

// MaxPacket is the largest packet sent so far, in bytes.
func (l *Lossy) MaxPacket() uint64 { return l.maxPacket.Load() }

// MaxStream is the most bytes sent so far on one stream, either way, by
// this end: a push-pull's full state, or a join's.
func (l *Lossy) MaxStream() uint64 { return l.maxStream.Load() }

// BytesSent is every byte sent so far, packets and streams.
func (l *Lossy) BytesSent() uint64 { return l.bytesSent.Load() }

// Packets returns the packets sent and lost so far.
func (l *Lossy) Packets() (sent, lost uint64) { return l.packetsSent.Load(), l.packetsLost.Load() }

func (l *Lossy) lose() bool {
	p := l.loss.Load()
	if p == 0 {
		return false
	}
	l.rngMu.Lock()
	defer l.rngMu.Unlock()
	return l.rng.Uint64N(1e9) < p
}

// WriteTo counts and maybe loses a packet.
func (l *Lossy) WriteTo(b []byte, addr string) (time.Time, error) {
	return l.WriteToAddress(b, memberlist.Address{Addr: addr})
}

// WriteToAddress counts and maybe loses a packet.
func (l *Lossy) WriteToAddress(b []byte, a memberlist.Address) (time.Time, error) {
	l.packetsSent.Add(1)
	l.bytesSent.Add(uint64(len(b)))
	storeMax(&l.maxPacket, uint64(len(b)))
	if l.lose() {
		l.packetsLost.Add(1)
		return time.Now(), nil
	}
	if d := time.Duration(l.delay.Load()); d > 0 {
		// The caller may reuse b once this returns, as with a socket.
		buf := append([]byte(nil), b...)
		time.AfterFunc(d, func() { l.NodeAwareTransport.WriteToAddress(buf, a) })
		return time.Now(), nil
	}
	return l.NodeAwareTransport.WriteToAddress(b, a)
}

// storeMax raises m to v if v is larger.
func storeMax(m *atomic.Uint64, v uint64) {
	for {
		old := m.Load()
		if v <= old || m.CompareAndSwap(old, v) {
			return
		}
	}
}

// DialTimeout opens a counted stream.
func (l *Lossy) DialTimeout(addr string, timeout time.Duration) (net.Conn, error) {
	return l.DialAddressTimeout(memberlist.Address{Addr: addr}, timeout)
}

// DialAddressTimeout opens a counted stream.
func (l *Lossy) DialAddressTimeout(a memberlist.Address, timeout time.Duration) (net.Conn, error) {
	c, err := l.NodeAwareTransport.DialAddressTimeout(a, timeout)
	if err != nil {
		return nil, err
	}
	return &countingConn{Conn: c, n: &l.bytesSent, max: &l.maxStream}, nil
}

// StreamCh delivers inbound streams, counted.
func (l *Lossy) StreamCh() <-chan net.Conn { return l.streams }

// routineStreams wraps inbound streams until Shutdown.
func (l *Lossy) routineStreams() {
	defer l.wg.Done()
	for {
		select {
		case c := <-l.NodeAwareTransport.StreamCh():
			select {
			case l.streams <- &countingConn{Conn: c, n: &l.bytesSent, max: &l.maxStream}:
			case <-l.done:
				c.Close()
				return
			}
		case <-l.done:
			return
		}
	}
}

// Shutdown shuts the inner transport down and stops the stream wrapper.
// The inner transport goes first: a NetTransport's listener may be blocked
// handing a stream to the wrapper, which must still take it.
func (l *Lossy) Shutdown() error {
	var err error
	l.once.Do(func() {
		stop := make(chan struct{})
		var drain sync.WaitGroup
		drain.Add(1)
		go func() {
			defer drain.Done()
			for {
				select {
				case c := <-l.streams:
					c.Close()
				case <-stop:
					return
				}
			}
		}()
		err = l.NodeAwareTransport.Shutdown()
		close(l.done)
		l.wg.Wait()
		close(stop)
		drain.Wait()
	})
	return err
}

type countingConn struct {
	net.Conn
	n, max *atomic.Uint64
	sent   atomic.Uint64 // on this stream
}

func (c *countingConn) Write(b []byte) (int, error) {
	n, err := c.Conn.Write(b)
	c.n.Add(uint64(n))
	storeMax(c.max, c.sent.Add(uint64(n)))
	return n, err
}
