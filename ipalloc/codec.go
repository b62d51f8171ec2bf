package ipalloc

import (
	"encoding/binary"
	"errors"
	"fmt"
	"slices"
)

// The wire format of the ring and of the messages between peers. Everything
// here decodes bytes from other peers: every length is checked against what
// is left, every count is bounded, and the decoded value is validated, so a
// bad message is an error and never a panic or a huge allocation.
//
//	message  = format(1 byte, 1) kind(1 byte) body
//	ring     = start(4) end(4) seed(8) npeers(uvarint) name* nentries(uvarint) entry*
//	name     = len(uvarint, 1..64) bytes
//	entry    = token-delta(uvarint) peer-index(uvarint) version(uvarint) free(uvarint)
//	ballot   = round(uvarint) name
//	paxos    = ballot accepted-ballot(round 0 and no name: none) nvalue(uvarint) name* [ext]
//	ext      = ext-version(1 byte, 1) size(uvarint, 1..10000)
//	remove   = name [by-version(1 byte, 1) name]
//	rmack    = name ring [members-version(1 byte, 1 or 2) nmembers(uvarint) name* [addrs]]
//	want     = addrs
//	members  = ask(1 byte, 0 or 1) nmembers(uvarint) name*
//	addrs    = naddrs(uvarint) addr-delta(uvarint)*   (version 2 of rmack only)
//
// A Paxos message without ext comes from a peer that predates it (its
// consensus size is not known, and not checked); an ext-version above 1
// is from a newer weft and is refused with a message that says so.
//
// Integers are big-endian; token deltas are from the previous token (the
// first from the universe's start).

const wireFormat = 1

// paxosExtVersion is the version of the fields that follow a Paxos value.
const paxosExtVersion = 1

// removeExtVersion is the version of the field that follows a Remove's
// peer (By).
const removeExtVersion = 1

// removeAckExtVersion is the version of the fields that follow a
// RemoveAck's ring (its members). A RemoveAck without them comes from a
// peer that predates them: the reclaimer learns no members from it.
// Version 2 adds the addresses in use on the acknowledger's node (InUse);
// it is sent only when there are any, so that a peer of an older weft
// refuses only those acknowledgements (with an error that says to upgrade).
const removeAckExtVersion = 1

// removeAckInUseVersion is the RemoveAck field version with InUse.
const removeAckInUseVersion = 2

// msgKind is the second byte of every message.
type msgKind byte

const (
	kindRing msgKind = iota + 1
	kindPrepare
	kindPromise
	kindAccept
	kindAccepted
	kindNack
	kindDonateRequest
	kindDonation
	kindDenial
	kindRemove
	kindRemoveAck
	kindHandover
	kindHandoverAck
	kindWithdraw
	kindWithdrawAck
	kindAskRemoved
	kindWant
	kindMembers
	kindEnd // one past the last
)

// Msg is a message between the IPAM cores of two peers: one of *RingMsg,
// *PaxosMsg, *DonateRequest, *Donation, *Denial, *Remove, *RemoveAck,
// *Handover, *HandoverAck, *Withdraw, *WithdrawAck, *AskRemoved, *Want,
// *Members.
type Msg interface {
	kind() msgKind
}

// RingMsg carries a peer's ring (gossip, and the answer to a Paxos message
// once the ring is claimed).
type RingMsg struct{ Ring *Ring }

// DonateRequest asks a peer for some of its free space. ID ties the answer
// to the request.
type DonateRequest struct{ ID uint64 }

// Donation answers a DonateRequest with the donor's ring, in which some of
// its space now belongs to the requester.
type Donation struct {
	ID   uint64
	Ring *Ring
}

// Denial answers a DonateRequest when the donor has nothing to give.
type Denial struct{ ID uint64 }

// Remove tells a peer that Peer is gone for good (weft rmpeer): from now on
// it must ignore every message from Peer, and answer with a RemoveAck.
//
// With By, it is news, not a request: the sender records that By removes
// Peer. Sent to By (a reminder: the sender still sees Peer own ranges), an
// addressee that has no record of it lost its state while it was
// reclaiming Peer, and takes the reclaim up again. Sent to another peer
// (the answer to its AskRemoved), an addressee without a record learns the
// removal and acknowledges it to By (peer_removal.go). It is not answered.
type Remove struct {
	Peer PeerName
	By   PeerName
}

// RemoveAck acknowledges a Remove with the acknowledger's ring and the
// members of its barrier (the peers it knows share the ring, not removed):
// the reclaimer waits for those too (peer_removal.go), since one of them
// may hold a change of Peer's that neither of them has seen.
//
// InUse lists addresses in use on the acknowledger's node that its state
// does not hold (pods found on its bridge after its state was lost) and
// its ring gives to other peers: at the takeover, the reclaimer hands
// those that are Peer's to the acknowledger instead of taking them
// (peer_found.go).
type RemoveAck struct {
	Peer    PeerName
	Ring    *Ring
	Members []PeerName
	InUse   []Address // sorted, unique
}

// Handover gives a peer every range of a peer that leaves the cluster
// (weft reset): Ring is the leaving peer's ring, in which they now belong
// to the addressee. ID ties the answer to it.
type Handover struct {
	ID   uint64
	Ring *Ring
}

// HandoverAck answers a Handover once the addressee has saved it. From a
// peer that has left itself, it names that peer's heir instead: hand the
// ranges to Heir.
type HandoverAck struct {
	ID   uint64
	Heir PeerName // empty: saved
}

// Withdraw calls off the removal of Peer that the sender started (its
// barrier was still open, so nothing of Peer's was taken over): a peer
// that recorded the removal by the sender forgets it, and Peer itself
// allocates again. Answered with a WithdrawAck.
type Withdraw struct{ Peer PeerName }

// WithdrawAck acknowledges a Withdraw.
type WithdrawAck struct{ Peer PeerName }

// AskRemoved asks a peer which of Peers it records as removed: a peer
// waits for them (a reclaim's barrier, or the hold of a peer that started
// without state), and a removal that reached it before it lost its state,
// or that it was never told, would hold it forever. Answered with a
// Remove{Peer, By} for each one the addressee records as removed, nothing
// for the others.
type AskRemoved struct{ Peers []PeerName }

// Want asks the owner of Addrs for them: they are in use on the sender's
// node, which lost its state (pods found on its bridge), and the sender's
// ring gives them to the addressee. The owner gives those it does not hold
// and answers with its ring (peer_found.go).
type Want struct {
	Addrs []Address // sorted, unique
}

// Members tells a peer the members the sender knows (the peers that share
// the ring, as far as it ever learned, less those it records as removed).
// With Ask, the addressee answers with its own. A peer that starts without
// state and owns ranges in the ring it learns asks every peer it hears
// from, and waits for each member it learns of too (peer_rejoin.go).
// An answer carries the addresses the sender's node uses that its state
// does not own (InUse, as in a RemoveAck): the asker ends its hold on the
// answers, so what it must give away comes with them.
type Members struct {
	Ask   bool
	Peers []PeerName // sorted, unique
	InUse []Address  // sorted, unique; only in an answer
}

func (*Members) kind() msgKind     { return kindMembers }
func (*AskRemoved) kind() msgKind  { return kindAskRemoved }
func (*Want) kind() msgKind        { return kindWant }
func (*Withdraw) kind() msgKind    { return kindWithdraw }
func (*WithdrawAck) kind() msgKind { return kindWithdrawAck }

func (*RingMsg) kind() msgKind       { return kindRing }
func (*DonateRequest) kind() msgKind { return kindDonateRequest }
func (*Donation) kind() msgKind      { return kindDonation }
func (*Denial) kind() msgKind        { return kindDenial }
func (*Remove) kind() msgKind        { return kindRemove }
func (*RemoveAck) kind() msgKind     { return kindRemoveAck }
func (*Handover) kind() msgKind      { return kindHandover }
func (*HandoverAck) kind() msgKind   { return kindHandoverAck }

// Limits of decoded data.
const (
	maxWireEntries = 1 << 20 // ring entries (a /8 split into 16-address pieces)
	maxWireValue   = 10000   // peers in a Paxos value (--ipalloc-init consensus=N allows up to 10000)
	maxWireAddrs   = 4096    // addresses in a Want or a RemoveAck's InUse (pods on one node)
)

// ErrBadMessage is wrapped by every decoding error.
var ErrBadMessage = errors.New("bad ipalloc message")

// EncodeMsg encodes m for the wire.
func EncodeMsg(m Msg) []byte {
	b := []byte{wireFormat, byte(m.kind())}
	switch m := m.(type) {
	case *RingMsg:
		b = appendRing(b, m.Ring)
	case *PaxosMsg:
		b = appendBallot(b, m.Ballot)
		b = appendBallot(b, m.Accepted)
		b = binary.AppendUvarint(b, uint64(len(m.Value)))
		for _, p := range m.Value {
			b = appendName(b, p)
		}
		if m.Size != 0 {
			b = append(b, paxosExtVersion)
			b = binary.AppendUvarint(b, uint64(m.Size))
		}
	case *DonateRequest:
		b = binary.AppendUvarint(b, m.ID)
	case *Donation:
		b = binary.AppendUvarint(b, m.ID)
		b = appendRing(b, m.Ring)
	case *Denial:
		b = binary.AppendUvarint(b, m.ID)
	case *Remove:
		b = appendName(b, m.Peer)
		if m.By != "" {
			b = appendName(append(b, removeExtVersion), m.By)
		}
	case *Withdraw:
		b = appendName(b, m.Peer)
	case *WithdrawAck:
		b = appendName(b, m.Peer)
	case *AskRemoved:
		b = binary.AppendUvarint(b, uint64(len(m.Peers)))
		for _, q := range m.Peers {
			b = appendName(b, q)
		}
	case *RemoveAck:
		b = appendName(b, m.Peer)
		b = appendRing(b, m.Ring)
		if len(m.Members) > 0 || len(m.InUse) > 0 {
			v := byte(removeAckExtVersion)
			if len(m.InUse) > 0 {
				v = removeAckInUseVersion
			}
			b = append(b, v)
			b = binary.AppendUvarint(b, uint64(len(m.Members)))
			for _, q := range m.Members {
				b = appendName(b, q)
			}
			if len(m.InUse) > 0 {
				b = appendAddrs(b, m.InUse)
			}
		}
	case *Want:
		b = appendAddrs(b, m.Addrs)
	case *Members:
		ask := byte(0)
		if m.Ask {
			ask = 1
		}
		b = binary.AppendUvarint(append(b, ask), uint64(len(m.Peers)))
		for _, q := range m.Peers {
			b = appendName(b, q)
		}
		if len(m.InUse) > 0 {
			b = appendAddrs(b, m.InUse)
		}
	case *Handover:
		b = binary.AppendUvarint(b, m.ID)
		b = appendRing(b, m.Ring)
	case *HandoverAck:
		b = binary.AppendUvarint(b, m.ID)
		if m.Heir == "" {
			b = append(b, 0)
		} else {
			b = appendName(append(b, 1), m.Heir)
		}
	}
	return b
}

// DecodeMsg decodes and validates a message from another peer.
func DecodeMsg(data []byte) (Msg, error) {
	if len(data) < 2 {
		return nil, fmt.Errorf("%w: %d bytes, too short", ErrBadMessage, len(data))
	}
	if data[0] != wireFormat {
		return nil, fmt.Errorf("%w: format %d, this peer speaks %d (are all peers running the same weft version?)", ErrBadMessage, data[0], wireFormat)
	}
	d := &decoder{b: data[2:]}
	var m Msg
	switch k := msgKind(data[1]); k {
	case kindRing:
		m = &RingMsg{Ring: d.ring()}
	case kindPrepare, kindPromise, kindAccept, kindAccepted, kindNack:
		pm := &PaxosMsg{Type: PaxosType(k - kindPrepare + 1)}
		pm.Ballot = d.ballot()
		pm.Accepted = d.ballot()
		n := d.count(maxWireValue, 2)
		for i := 0; i < n && d.err == nil; i++ {
			pm.Value = append(pm.Value, d.name())
		}
		if d.err == nil && len(d.b) > 0 {
			switch v := d.fixed(1)[0]; v {
			case paxosExtVersion:
				size := d.uvarint()
				if d.err == nil && (size == 0 || size > maxWireValue) {
					d.fail("paxos: consensus size %d, not 1..%d", size, maxWireValue)
				}
				pm.Size = uint32(size)
			default:
				d.fail("paxos: fields of version %d, this peer reads %d (are all peers running the same weft version?)", v, paxosExtVersion)
			}
		}
		m = pm
	case kindDonateRequest:
		m = &DonateRequest{ID: d.uvarint()}
	case kindDonation:
		dm := &Donation{ID: d.uvarint()}
		dm.Ring = d.ring()
		m = dm
	case kindDenial:
		m = &Denial{ID: d.uvarint()}
	case kindRemove:
		rm := &Remove{Peer: d.name()}
		if d.err == nil && len(d.b) > 0 {
			switch v := d.fixed(1)[0]; v {
			case removeExtVersion:
				rm.By = d.name()
			default:
				d.fail("remove: fields of version %d, this peer reads %d (are all peers running the same weft version?)", v, removeExtVersion)
			}
		}
		m = rm
	case kindWithdraw:
		m = &Withdraw{Peer: d.name()}
	case kindWithdrawAck:
		m = &WithdrawAck{Peer: d.name()}
	case kindAskRemoved:
		am := &AskRemoved{}
		n := d.count(maxWireValue, 2)
		for i := 0; i < n && d.err == nil; i++ {
			am.Peers = append(am.Peers, d.name())
		}
		m = am
	case kindRemoveAck:
		am := &RemoveAck{Peer: d.name()}
		am.Ring = d.ring()
		if d.err == nil && len(d.b) > 0 {
			switch v := d.fixed(1)[0]; v {
			case removeAckExtVersion, removeAckInUseVersion:
				n := d.count(maxWireEntries, 2)
				for i := 0; i < n && d.err == nil; i++ {
					am.Members = append(am.Members, d.name())
				}
				if v == removeAckInUseVersion {
					am.InUse = d.addrs()
					if d.err == nil && len(am.InUse) == 0 {
						d.fail("remove ack: fields of version %d without addresses", v)
					}
				}
			default:
				d.fail("remove ack: fields of version %d, this peer reads up to %d (are all peers running the same weft version?)", v, removeAckInUseVersion)
			}
		}
		m = am
	case kindWant:
		m = &Want{Addrs: d.addrs()}
	case kindMembers:
		mm := &Members{}
		switch f := d.fixed(1)[0]; {
		case f == 1:
			mm.Ask = true
		case f != 0:
			d.fail("members: flag %d", f)
		}
		n := d.count(maxWireEntries, 2)
		for i := 0; i < n && d.err == nil; i++ {
			q := d.name()
			if len(mm.Peers) > 0 && q <= mm.Peers[len(mm.Peers)-1] {
				d.fail("members: names not sorted and unique")
			}
			mm.Peers = append(mm.Peers, q)
		}
		if d.err == nil && len(d.b) > 0 {
			mm.InUse = d.addrs()
			if d.err == nil && len(mm.InUse) == 0 {
				d.fail("members: an empty list of addresses in use")
			}
		}
		m = mm
	case kindHandover:
		hm := &Handover{ID: d.uvarint()}
		hm.Ring = d.ring()
		m = hm
	case kindHandoverAck:
		am := &HandoverAck{ID: d.uvarint()}
		switch f := d.fixed(1)[0]; {
		case f == 1:
			am.Heir = d.name()
		case f != 0:
			d.fail("handover ack: flag %d", f)
		}
		m = am
	default:
		return nil, fmt.Errorf("%w: unknown kind %d", ErrBadMessage, k)
	}
	if d.err == nil && len(d.b) > 0 {
		d.fail("%d bytes left over", len(d.b))
	}
	if d.err != nil {
		return nil, d.err
	}
	if pm, ok := m.(*PaxosMsg); ok {
		if err := pm.validate(); err != nil {
			return nil, fmt.Errorf("%w: %w", ErrBadMessage, err)
		}
	}
	return m, nil
}

// EncodeRing encodes a ring on its own (for a full-state exchange).
func EncodeRing(r *Ring) []byte { return appendRing([]byte{wireFormat}, r) }

// DecodeRing decodes and validates a ring made by EncodeRing.
func DecodeRing(data []byte) (*Ring, error) {
	if len(data) < 1 || data[0] != wireFormat {
		return nil, fmt.Errorf("%w: not a ring of format %d", ErrBadMessage, wireFormat)
	}
	d := &decoder{b: data[1:]}
	r := d.ring()
	if d.err == nil && len(d.b) > 0 {
		d.fail("%d bytes left over", len(d.b))
	}
	return r, d.err
}

func appendName(b []byte, n PeerName) []byte {
	b = binary.AppendUvarint(b, uint64(len(n)))
	return append(b, n...)
}

// appendAddrs appends sorted, unique addresses as deltas (the first
// from 0).
func appendAddrs(b []byte, as []Address) []byte {
	b = binary.AppendUvarint(b, uint64(len(as)))
	prev := uint64(0)
	for _, a := range as {
		b = binary.AppendUvarint(b, uint64(a)-prev)
		prev = uint64(a)
	}
	return b
}

func appendBallot(b []byte, bl Ballot) []byte {
	b = binary.AppendUvarint(b, uint64(bl.Round))
	if bl.Round == 0 {
		return b
	}
	return appendName(b, bl.Peer)
}

func appendRing(b []byte, r *Ring) []byte {
	b = binary.BigEndian.AppendUint32(b, uint32(r.Universe.Start))
	b = binary.BigEndian.AppendUint32(b, uint32(r.Universe.End))
	b = binary.BigEndian.AppendUint64(b, uint64(r.Seed))
	peers := r.Peers()
	b = binary.AppendUvarint(b, uint64(len(peers)))
	for _, p := range peers {
		b = appendName(b, p)
	}
	b = binary.AppendUvarint(b, uint64(len(r.Entries)))
	prev := r.Universe.Start
	for _, e := range r.Entries {
		idx, _ := slices.BinarySearch(peers, e.Peer)
		b = binary.AppendUvarint(b, uint64(e.Token-prev))
		b = binary.AppendUvarint(b, uint64(idx))
		b = binary.AppendUvarint(b, uint64(e.Version))
		b = binary.AppendUvarint(b, uint64(e.Free))
		prev = e.Token
	}
	return b
}

// decoder reads the wire format; the first error sticks and later reads
// return zero values.
type decoder struct {
	b   []byte
	err error
}

func (d *decoder) fail(format string, args ...any) {
	if d.err == nil {
		d.err = fmt.Errorf("%w: %s", ErrBadMessage, fmt.Sprintf(format, args...))
	}
}

func (d *decoder) uvarint() uint64 {
	if d.err != nil {
		return 0
	}
	v, n := binary.Uvarint(d.b)
	if n <= 0 {
		d.fail("truncated or overlong number")
		return 0
	}
	d.b = d.b[n:]
	return v
}

func (d *decoder) uint32v() uint32 {
	v := d.uvarint()
	if v > 0xffffffff {
		d.fail("number %d does not fit 32 bits", v)
		return 0
	}
	return uint32(v)
}

func (d *decoder) fixed(n int) []byte {
	if d.err != nil {
		return make([]byte, n)
	}
	if len(d.b) < n {
		d.fail("truncated")
		return make([]byte, n)
	}
	v := d.b[:n]
	d.b = d.b[n:]
	return v
}

// count reads a count of items that take at least minSize bytes each.
func (d *decoder) count(limit, minSize int) int {
	v := d.uvarint()
	if v > uint64(limit) || v*uint64(minSize) > uint64(len(d.b)) {
		d.fail("count %d is more than the message can hold", v)
		return 0
	}
	return int(v)
}

func (d *decoder) name() PeerName {
	n := d.uvarint()
	if d.err != nil {
		return ""
	}
	if n == 0 || n > MaxPeerNameLen || n > uint64(len(d.b)) {
		d.fail("peer name of %d bytes", n)
		return ""
	}
	p := PeerName(d.fixed(int(n)))
	if err := ValidatePeerName(p); err != nil {
		d.fail("%v", err)
		return ""
	}
	return p
}

// addrs reads what appendAddrs wrote: at most maxWireAddrs addresses,
// strictly increasing.
func (d *decoder) addrs() []Address {
	n := d.count(maxWireAddrs, 1)
	var out []Address
	a := uint64(0)
	for i := 0; i < n && d.err == nil; i++ {
		delta := d.uvarint()
		if d.err != nil {
			break
		}
		if i > 0 && delta == 0 {
			d.fail("addresses not sorted and unique")
			break
		}
		a += delta
		if a > 0xffffffff {
			d.fail("address %d does not fit 32 bits", a)
			break
		}
		out = append(out, Address(a))
	}
	if d.err != nil {
		return nil
	}
	return out
}

func (d *decoder) ballot() Ballot {
	round := d.uint32v()
	if round == 0 || d.err != nil {
		return Ballot{}
	}
	return Ballot{Round: round, Peer: d.name()}
}

func (d *decoder) ring() *Ring {
	f := d.fixed(16)
	r := &Ring{
		Universe: Range{Address(binary.BigEndian.Uint32(f)), Address(binary.BigEndian.Uint32(f[4:]))},
		Seed:     Seed(binary.BigEndian.Uint64(f[8:])),
	}
	np := d.count(maxWireEntries, 2)
	peers := make([]PeerName, 0, np)
	for i := 0; i < np && d.err == nil; i++ {
		p := d.name()
		if len(peers) > 0 && p <= peers[len(peers)-1] {
			d.fail("ring peer names are not sorted and unique")
		}
		peers = append(peers, p)
	}
	ne := d.count(maxWireEntries, 4)
	if d.err == nil && ne > 0 {
		r.Entries = make([]Entry, 0, ne)
	}
	token := uint64(r.Universe.Start)
	for i := 0; i < ne && d.err == nil; i++ {
		delta, idx, version, free := d.uvarint(), d.uvarint(), d.uint32v(), d.uint32v()
		token += delta
		if d.err != nil {
			break
		}
		if token > 0xffffffff || (i > 0 && delta == 0) {
			d.fail("ring entry %d: bad token", i)
			break
		}
		if idx >= uint64(len(peers)) {
			d.fail("ring entry %d: peer %d of %d", i, idx, len(peers))
			break
		}
		r.Entries = append(r.Entries, Entry{Token: Address(token), Peer: peers[idx], Version: version, Free: free})
	}
	if d.err != nil {
		return nil
	}
	if err := r.Validate(); err != nil {
		d.fail("%v", err)
		return nil
	}
	if !r.Empty() && r.Seed == 0 {
		d.fail("a claimed ring without a seed")
		return nil
	}
	return r
}
