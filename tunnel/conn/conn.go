// Package conn is weft's seam at the underlay socket: an interface that
// moves batches of encapsulated packets to and from other nodes, with the
// Linux implementations (a UDP socket, a raw IPIP socket) over
// golang.org/x/net's recvmmsg/sendmmsg in conn_linux.go and a channel fake
// in conn/bindtest, after wireguard-go's conn.Bind.
package conn

import (
	"errors"
	"net/netip"
)

// Message is one datagram on the underlay.
type Message struct {
	// Buf is set by Recv: memory of the bind around Data that the caller
	// may read and write until its next Recv. Data starts at least
	// Headroom bytes into Buf, so that a header can be put in front of
	// it in place. Send ignores Buf.
	Buf []byte
	// Data is the payload: what Send sends; for Recv, the datagram (for
	// IPIP, what follows the outer IP header).
	Data []byte
	// Addr is the destination for Send and the source after Recv. IPIP
	// has no ports: its port is 0.
	Addr netip.AddrPort
	// Mark says the packet is being forwarded once more by a node that
	// was not its destination's owner. An IPIP bind carries it in the
	// outer header's DSCP (MarkDSCP); a UDP bind ignores it, since the
	// udp frame header has its own flag.
	Mark bool
}

// Headroom is the room in front of a received datagram's Data.
const Headroom = 16

// Bind is one underlay socket.
type Bind interface {
	// Recv waits for at least one datagram and returns up to len(msgs),
	// setting Buf, Data, Addr and Mark of each; they stay valid until the
	// next Recv. A datagram that is not a valid packet of the bind's kind
	// (an IPIP packet with a broken outer header) is skipped. Recv is
	// called from one goroutine at a time.
	Recv(msgs []Message) (n int, err error)
	// Send sends msgs[i].Data to msgs[i].Addr for every i. It is safe for
	// concurrent use. A message that the kernel refuses is skipped; Send
	// returns how many were sent and the first error.
	Send(msgs []Message) (n int, err error)
	// BatchSize is the most messages one call handles efficiently.
	BatchSize() int
	// LocalPort is the port the bind listens on (0 for IPIP).
	LocalPort() uint16
	// Close closes the socket and unblocks Recv with ErrClosed.
	Close() error
}

// MarkDSCP is the DSCP value of the outer IPIP header that marks a
// forwarded packet: 3, from the pool the DSCP registry leaves for
// experimental and local use.
const MarkDSCP = 3

// ErrClosed is returned by a closed bind.
var ErrClosed = errors.New("underlay socket closed")
