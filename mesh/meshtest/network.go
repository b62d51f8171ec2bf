// Package meshtest is an in-memory network for memberlist, so that many
// mesh peers run in one test process without sockets: packets (UDP-like,
// may be lost) and streams (TCP-like, net.Pipe) between transports, with
// partitions, and a wrapper that loses packets and counts bytes. It is a
// real package, like wireguard-go's tuntest, for every package that needs
// a mesh in its tests.
//
// Unlike memberlist's MockNetwork, a transport can shut down and come back
// at the same address (a restart), a send to a peer that is gone never
// blocks, and the network is safe for concurrent use.
package meshtest

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"sync"
	"syscall"
	"time"

	"github.com/hashicorp/memberlist"
)

// packetQueue is each transport's inbound packet buffer; a packet to a full
// queue is lost, as UDP would lose it.
const packetQueue = 1024

// Network connects Transports by address.
type Network struct {
	mu    sync.Mutex
	nodes map[netip.AddrPort]*Transport
	cut   map[[2]netip.AddrPort]bool // blocked pairs, both orders stored
}

// NewNetwork returns an empty network.
func NewNetwork() *Network {
	return &Network{nodes: map[netip.AddrPort]*Transport{}, cut: map[[2]netip.AddrPort]bool{}}
}

// ErrAddrInUse is NewTransport's error for an address taken by a live
// transport.
var ErrAddrInUse = errors.New("address already in use")

// NewTransport returns a transport listening at addr ("10.0.0.1:6783").
func (n *Network) NewTransport(addr string) (*Transport, error) {
	ap, err := netip.ParseAddrPort(addr)
	if err != nil {
		return nil, fmt.Errorf("meshtest: address %q: %w", addr, err)
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	if _, ok := n.nodes[ap]; ok {
		return nil, fmt.Errorf("meshtest: %s: %w", ap, ErrAddrInUse)
	}
	t := &Transport{
		net:      n,
		addr:     ap,
		packetCh: make(chan *memberlist.Packet, packetQueue),
		streamCh: make(chan net.Conn),
		done:     make(chan struct{}),
	}
	n.nodes[ap] = t
	return t, nil
}

// Partition cuts every pair between the two groups of addresses, both
// ways. Streams already open are not cut.
func (n *Network) Partition(a, b []string) {
	n.mu.Lock()
	defer n.mu.Unlock()
	for _, x := range a {
		for _, y := range b {
			xa, ya := netip.MustParseAddrPort(x), netip.MustParseAddrPort(y)
			n.cut[[2]netip.AddrPort{xa, ya}] = true
			n.cut[[2]netip.AddrPort{ya, xa}] = true
		}
	}
}

// Heal removes every cut.
func (n *Network) Heal() {
	n.mu.Lock()
	defer n.mu.Unlock()
	clear(n.cut)
}

// route returns the live transport at to, or nil when there is none or the
// pair is cut.
func (n *Network) route(from, to netip.AddrPort) *Transport {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.cut[[2]netip.AddrPort{from, to}] {
		return nil
	}
	return n.nodes[to]
}

func (n *Network) remove(t *Transport) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.nodes[t.addr] == t {
		delete(n.nodes, t.addr)
	}
}

// Transport is one peer's memberlist.NodeAwareTransport on a Network.
type Transport struct {
	net      *Network
	addr     netip.AddrPort
	packetCh chan *memberlist.Packet
	streamCh chan net.Conn
	done     chan struct{}
	once     sync.Once
}

var _ memberlist.NodeAwareTransport = (*Transport)(nil)

// Addr is the transport's address.
func (t *Transport) Addr() netip.AddrPort { return t.addr }

// FinalAdvertiseAddr advertises the transport's own address.
func (t *Transport) FinalAdvertiseAddr(string, int) (net.IP, int, error) {
	return t.addr.Addr().AsSlice(), int(t.addr.Port()), nil
}

// WriteTo sends a packet; like UDP it succeeds even when nobody receives.
func (t *Transport) WriteTo(b []byte, addr string) (time.Time, error) {
	return t.WriteToAddress(b, memberlist.Address{Addr: addr})
}

// WriteToAddress sends a packet; like UDP it succeeds even when nobody
// receives.
func (t *Transport) WriteToAddress(b []byte, a memberlist.Address) (time.Time, error) {
	now := time.Now()
	to, err := netip.ParseAddrPort(a.Addr)
	if err != nil {
		return now, fmt.Errorf("meshtest: address %q: %w", a.Addr, err)
	}
	dest := t.net.route(t.addr, to)
	if dest == nil {
		return now, nil
	}
	p := &memberlist.Packet{
		Buf:       append([]byte(nil), b...),
		From:      net.UDPAddrFromAddrPort(t.addr),
		Timestamp: now,
	}
	select {
	case <-dest.done:
	case dest.packetCh <- p:
	default: // full: lost
	}
	return now, nil
}

// PacketCh delivers inbound packets.
func (t *Transport) PacketCh() <-chan *memberlist.Packet { return t.packetCh }

// DialTimeout opens a stream to addr.
func (t *Transport) DialTimeout(addr string, timeout time.Duration) (net.Conn, error) {
	return t.DialAddressTimeout(memberlist.Address{Addr: addr}, timeout)
}

// DialAddressTimeout opens a stream; a missing or cut destination is
// refused at once, as a closed port would be.
func (t *Transport) DialAddressTimeout(a memberlist.Address, timeout time.Duration) (net.Conn, error) {
	to, err := netip.ParseAddrPort(a.Addr)
	if err != nil {
		return nil, fmt.Errorf("meshtest: address %q: %w", a.Addr, err)
	}
	dest := t.net.route(t.addr, to)
	if dest == nil {
		return nil, &net.OpError{Op: "dial", Net: "tcp", Addr: net.TCPAddrFromAddrPort(to), Err: syscall.ECONNREFUSED}
	}
	local, remote := net.Pipe()
	timer := time.NewTimer(timeout)
	defer timer.Stop()
	select {
	case dest.streamCh <- remote:
		return local, nil
	case <-dest.done:
	case <-t.done:
	case <-timer.C:
	}
	local.Close()
	remote.Close()
	return nil, &net.OpError{Op: "dial", Net: "tcp", Addr: net.TCPAddrFromAddrPort(to), Err: syscall.ECONNREFUSED}
}

// StreamCh delivers inbound streams.
func (t *Transport) StreamCh() <-chan net.Conn { return t.streamCh }

// Shutdown takes the transport off the network; its address is free again.
func (t *Transport) Shutdown() error {
	t.once.Do(func() {
		close(t.done)
		t.net.remove(t)
	})
	return nil
}
