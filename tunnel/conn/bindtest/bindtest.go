// Package bindtest is a channel-backed fake underlay: binds on a shared
// Network send datagrams to each other by address, so that two tunnel
// devices can talk in a test without root (after wireguard-go's
// conn/bindtest).
package bindtest

import (
	"net/netip"
	"sync"

	"github.com/weft-net/weft/tunnel/conn"
)

// Packet is a datagram in flight on the fake network.
type Packet struct {
	From, To netip.AddrPort
	Data     []byte
	Mark     bool
}

// Network joins the binds made on it.
type Network struct {
	mu    sync.Mutex
	binds map[netip.AddrPort]*Bind
	tap   func(Packet)
}

// NewNetwork returns an empty network.
func NewNetwork() *Network { return &Network{binds: map[netip.AddrPort]*Bind{}} }

// Tap sets a function that sees every packet sent (and injected) before it
// is delivered, e.g. to check a header. It runs on the sender's goroutine.
func (n *Network) Tap(f func(Packet)) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.tap = f
}

// Bind makes a bind listening on addr (port 0 for an IPIP-like bind).
func (n *Network) Bind(addr netip.AddrPort) *Bind {
	b := &Bind{net: n, addr: addr, ch: make(chan Packet, 1024), closed: make(chan struct{})}
	n.mu.Lock()
	defer n.mu.Unlock()
	n.binds[addr] = b
	return b
}

// Inject delivers a datagram as if sent from an arbitrary address. It
// reports whether a bind listens on to.
func (n *Network) Inject(p Packet) bool {
	p.Data = append([]byte(nil), p.Data...)
	n.mu.Lock()
	dst, tap := n.binds[p.To], n.tap
	n.mu.Unlock()
	if tap != nil {
		tap(p)
	}
	if dst == nil {
		return false
	}
	select {
	case dst.ch <- p:
	case <-dst.closed:
	}
	return true
}

// Bind is one fake socket. Datagrams to an address that nobody listens on
// are lost, as on a real network.
type Bind struct {
	net    *Network
	addr   netip.AddrPort
	ch     chan Packet
	closed chan struct{}
	once   sync.Once
}

// Addr is the address the bind listens on.
func (b *Bind) Addr() netip.AddrPort { return b.addr }

// Recv implements conn.Bind. Each datagram is copied into fresh memory
// with conn.Headroom bytes in front of it.
func (b *Bind) Recv(msgs []conn.Message) (int, error) {
	n := 0
	for n < len(msgs) {
		var p Packet
		if n == 0 {
			select {
			case p = <-b.ch:
			case <-b.closed:
				return 0, conn.ErrClosed
			}
		} else {
			select {
			case p = <-b.ch:
			default:
				return n, nil
			}
		}
		m := &msgs[n]
		m.Buf = make([]byte, conn.Headroom+len(p.Data)+conn.Headroom)
		m.Data = m.Buf[conn.Headroom : conn.Headroom+copy(m.Buf[conn.Headroom:], p.Data)]
		m.Addr, m.Mark = p.From, p.Mark
		n++
	}
	return n, nil
}

// Send implements conn.Bind.
func (b *Bind) Send(msgs []conn.Message) (int, error) {
	select {
	case <-b.closed:
		return 0, conn.ErrClosed
	default:
	}
	for _, m := range msgs {
		to := m.Addr
		if b.addr.Port() == 0 {
			to = netip.AddrPortFrom(to.Addr(), 0)
		}
		b.net.Inject(Packet{From: b.addr, To: to, Data: m.Data, Mark: m.Mark && b.addr.Port() == 0})
	}
	return len(msgs), nil
}

// BatchSize implements conn.Bind.
func (b *Bind) BatchSize() int { return 16 }

// LocalPort implements conn.Bind.
func (b *Bind) LocalPort() uint16 { return b.addr.Port() }

// Close implements conn.Bind; the address is free again afterwards.
func (b *Bind) Close() error {
	b.once.Do(func() {
		close(b.closed)
		b.net.mu.Lock()
		if b.net.binds[b.addr] == b {
			delete(b.net.binds, b.addr)
		}
		b.net.mu.Unlock()
	})
	return nil
}
