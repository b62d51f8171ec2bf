package mesh

import (
	"errors"
	"fmt"
	"log"
	"net"
	"sync"
	"time"

	"github.com/hashicorp/go-sockaddr"
	"github.com/hashicorp/memberlist"
)

// udpTransport is the gossip port, TCP and UDP on one address: what
// memberlist's NetTransport does, with one difference that matters under
// a flood. NetTransport reads every datagram into a fresh 64 KiB buffer and
// holds it until memberlist has taken it, so 50,000 packets from anyone on
// the underlay allocate 3 GB and drive the heap (and the RSS) up faster
// than the collector reclaims it. This one reads into one buffer and hands
// on a copy of the datagram's size.
type udpTransport struct {
	tcp *net.TCPListener
	udp *net.UDPConn
	log *log.Logger

	packetCh chan *memberlist.Packet
	streamCh chan net.Conn
	done     chan struct{} // closed by Shutdown
	once     sync.Once
	wg       sync.WaitGroup
}

// udpRecvBuf is the receive buffer asked for the UDP socket (memberlist's
// choice); the kernel may grant less.
const udpRecvBuf = 2 << 20

// newUDPTransport listens on bind:port (TCP first; port 0 picks a free
// port for both).
func newUDPTransport(bind string, port int, logger *log.Logger) (*udpTransport, error) {
	ip := net.ParseIP(bind)
	if ip == nil {
		return nil, fmt.Errorf("bind address %q is not an IP address", bind)
	}
	tcp, err := net.ListenTCP("tcp", &net.TCPAddr{IP: ip, Port: port})
	if err != nil {
		return nil, err
	}
	port = tcp.Addr().(*net.TCPAddr).Port
	udp, err := net.ListenUDP("udp", &net.UDPAddr{IP: ip, Port: port})
	if err != nil {
		tcp.Close()
		return nil, err
	}
	for size := udpRecvBuf; size > 0; size /= 2 {
		if udp.SetReadBuffer(size) == nil {
			break
		}
	}
	t := &udpTransport{
		tcp: tcp, udp: udp, log: logger,
		packetCh: make(chan *memberlist.Packet),
		streamCh: make(chan net.Conn),
		done:     make(chan struct{}),
	}
	t.wg.Add(2)
	go t.routineAccept()
	go t.routineRead()
	return t, nil
}

// port is the bound port.
func (t *udpTransport) port() int { return t.tcp.Addr().(*net.TCPAddr).Port }

// FinalAdvertiseAddr is ip:port when ip is given; otherwise the bound
// address, or (bound to every address) a private address of this host.
func (t *udpTransport) FinalAdvertiseAddr(ip string, port int) (net.IP, int, error) {
	if ip != "" {
		a := net.ParseIP(ip)
		if a == nil {
			return nil, 0, fmt.Errorf("advertise address %q is not an IP address", ip)
		}
		if a4 := a.To4(); a4 != nil {
			a = a4
		}
		return a, port, nil
	}
	bound := t.tcp.Addr().(*net.TCPAddr).IP
	if !bound.IsUnspecified() {
		return bound, t.port(), nil
	}
	priv, err := sockaddr.GetPrivateIP()
	if err != nil {
		return nil, 0, fmt.Errorf("finding a private address to advertise: %w", err)
	}
	a := net.ParseIP(priv)
	if a == nil {
		return nil, 0, errors.New("no private IP address found to advertise")
	}
	return a, t.port(), nil
}

func (t *udpTransport) WriteTo(b []byte, addr string) (time.Time, error) {
	return t.WriteToAddress(b, memberlist.Address{Addr: addr})
}

func (t *udpTransport) WriteToAddress(b []byte, a memberlist.Address) (time.Time, error) {
	ua, err := net.ResolveUDPAddr("udp", a.Addr)
	if err != nil {
		return time.Time{}, err
	}
	_, err = t.udp.WriteTo(b, ua)
	return time.Now(), err
}

func (t *udpTransport) PacketCh() <-chan *memberlist.Packet { return t.packetCh }
func (t *udpTransport) StreamCh() <-chan net.Conn           { return t.streamCh }

func (t *udpTransport) DialTimeout(addr string, timeout time.Duration) (net.Conn, error) {
	d := net.Dialer{Timeout: timeout}
	return d.Dial("tcp", addr)
}

func (t *udpTransport) DialAddressTimeout(a memberlist.Address, timeout time.Duration) (net.Conn, error) {
	return t.DialTimeout(a.Addr, timeout)
}

// Shutdown closes both sockets and waits for the two routines.
func (t *udpTransport) Shutdown() error {
	t.once.Do(func() {
		close(t.done)
		t.tcp.Close()
		t.udp.Close()
		t.wg.Wait()
	})
	return nil
}

func (t *udpTransport) closing() bool {
	select {
	case <-t.done:
		return true
	default:
		return false
	}
}

// routineAccept hands every incoming stream on, backing off on errors
// (EMFILE under a flood of connections) as NetTransport does.
func (t *udpTransport) routineAccept() {
	defer t.wg.Done()
	var delay time.Duration
	for {
		c, err := t.tcp.AcceptTCP()
		if err != nil {
			if t.closing() {
				return
			}
			delay = min(max(2*delay, 5*time.Millisecond), time.Second)
			t.log.Printf("[ERR] memberlist: Error accepting TCP connection: %v", err)
			select {
			case <-time.After(delay):
			case <-t.done:
				return
			}
			continue
		}
		delay = 0
		select {
		case t.streamCh <- c:
		case <-t.done:
			c.Close()
			return
		}
	}
}

// routineRead hands every datagram on, copied out of the one read buffer.
func (t *udpTransport) routineRead() {
	defer t.wg.Done()
	buf := make([]byte, 65536)
	for {
		n, from, err := t.udp.ReadFrom(buf)
		now := time.Now()
		if err != nil {
			if t.closing() {
				return
			}
			t.log.Printf("[ERR] memberlist: Error reading UDP packet: %v", err)
			continue
		}
		p := &memberlist.Packet{Buf: append([]byte(nil), buf[:n]...), From: from, Timestamp: now}
		select {
		case t.packetCh <- p:
		case <-t.done:
			return
		}
	}
}
