package tunnel

import (
	"errors"
	"net/netip"
	"time"

	"github.com/weft-net/weft/tunnel/conn"
	"github.com/weft-net/weft/tunnel/crypt"
	"github.com/weft-net/weft/tunnel/tun"
)

// The packet path. Each goroutine owns its buffers and reuses them for
// every batch: a packet is read into a buffer at FrameHeaderLen, so that
// the udp header is written in place in front of it, sealed in place
// (the buffer has room for the tag behind it) and sent from there;
// received frames are opened in place. Nothing is allocated per packet.
// Each datagram is sealed on its own, so that the runs that the UDP bind
// joins into one GSO send stay runs of equal-sized datagrams.

// routineReadTUN reads packets that the kernel routed into TUN queue q
// and sends each to the owner of its destination.
func (d *Device) routineReadTUN(q tun.Queue) error {
	bs := d.tun.BatchSize()
	size := FrameHeaderLen + max(d.tun.MTU(), d.cfg.MTU) + AEADTagLen
	slab := make([]byte, bs*size)
	bufs := make([][]byte, bs)
	for i := range bufs {
		bufs[i] = slab[i*size : (i+1)*size : (i+1)*size]
	}
	sizes := make([]int, bs)
	var out [numWireModes][]conn.Message
	for i := range out {
		out[i] = make([]conn.Message, 0, bs)
	}
	const icmpSize = FrameHeaderLen + maxFragNeededLen // written at FrameHeaderLen, like every packet
	icmpSlab := make([]byte, bs*icmpSize)
	icmp := make([][]byte, 0, bs)
	var t tally
	sc := new(crypt.Scratch)
	for {
		n, err := q.Read(bufs, sizes, FrameHeaderLen)
		if n == 0 && err != nil {
			return d.endErr("reading "+d.tun.Name(), err)
		}
		s := d.snap.Load()
		var now time.Time
		if d.crypto != nil {
			now = d.now()
		}
		for i := range out {
			out[i] = out[i][:0]
		}
		icmp = icmp[:0]
		for i := range n {
			pkt, r := ipv4Check(bufs[i][FrameHeaderLen : FrameHeaderLen+sizes[i]])
			if r != dropNone {
				t.drop[r]++
				continue
			}
			owner, ok := s.routes.Owner(ipv4Dst(pkt))
			switch {
			case !ok:
				t.drop[dropNoRoute]++
				continue
			case owner == d.cfg.Self:
				t.drop[dropLocal]++
				continue
			}
			p, r := s.sendPath(owner)
			if r != dropNone {
				t.drop[r]++
				continue
			}
			mi := p.tunIdx
			if len(pkt) > d.maxInner[mi] && ipv4DF(pkt) {
				t.drop[dropTooBig]++
				if len(icmp) < cap(icmp) {
					b := icmpSlab[len(icmp)*icmpSize:][:icmpSize]
					// From the packet's destination, as if from a router on
					// the path: the kernel drops a packet from the TUN
					// device whose source is one of its own addresses
					// (such as the bridge's), and accepts this one, whose
					// reverse path is the TUN device itself.
					icmp = append(icmp, b[:FrameHeaderLen+fragNeeded(b[FrameHeaderLen:], pkt, ipv4Dst(pkt), d.maxInner[mi])])
					t.icmp++
				}
				continue
			}
			m, r := d.encap(mi, bufs[i], pkt, p, false, sc, now)
			if r != dropNone {
				t.drop[r]++
				continue
			}
			out[mi] = append(out[mi], m)
		}
		d.send(out[:], dirOut, &t)
		if len(icmp) > 0 {
			if _, err := q.Write(icmp, FrameHeaderLen); err != nil {
				if e := d.tunWriteErr(err, &t); e != nil {
					return e
				}
			}
		}
		d.metrics.flush(&t)
		if err != nil {
			return d.endErr("reading "+d.tun.Name(), err)
		}
	}
}

// encap wraps the inner packet pkt, which sits in buf at the offset the
// frame header needs in front of it, for mode mi to peer p. A udp frame
// to a peer that must encrypt is sealed in place (pkt needs AEADTagLen
// bytes of room behind it); the counter of a plaintext one is filled in
// by send.
func (d *Device) encap(mi int, buf, pkt []byte, p *peerPath, forwarded bool, sc *crypt.Scratch, now time.Time) (conn.Message, dropReason) {
	if mi == idxIPIP {
		return conn.Message{Data: pkt, Addr: p.dst[idxIPIP], Mark: forwarded}, dropNone
	}
	start := cap(buf) - cap(pkt) - FrameHeaderLen
	var flags FrameFlags
	if forwarded {
		flags = FlagForwarded
	}
	frame := buf[start : start+FrameHeaderLen+len(pkt)]
	if !p.plain {
		sealed, r := sealFrame(frame, flags, p, sc, now)
		return conn.Message{Data: sealed, Addr: p.dst[idxUDP]}, r
	}
	PutFrameHeader(frame, FrameHeader{Version: FrameVersion, Type: FrameData, Flags: flags})
	return conn.Message{Data: frame, Addr: p.dst[idxUDP]}, dropNone
}

// send numbers the udp frames and sends every batch on its socket,
// counting what went out in direction dir and what the socket refused.
func (d *Device) send(out [][]conn.Message, dir int, t *tally) {
	for mi, msgs := range out {
		if len(msgs) == 0 {
			continue
		}
		if mi == idxUDP {
			next := d.counter.Add(uint64(len(msgs))) - uint64(len(msgs))
			for i := range msgs {
				if !sealed(msgs[i].Data) {
					next++
					putCounter(msgs[i].Data, next)
				}
			}
		}
		n, err := d.binds[mi].Send(msgs)
		for _, m := range msgs[:n] {
			overhead := 0
			if mi == idxUDP {
				overhead = FrameHeaderLen
				if sealed(m.Data) {
					overhead += AEADTagLen
				}
			}
			t.count(dir, mi, len(m.Data)-overhead)
		}
		if err != nil {
			t.drop[dropSendError] += uint64(len(msgs) - n)
			d.log.Debug("underlay send failed", "mode", wireModes[mi], "err", err)
		}
	}
}

// sealed reports whether the udp frame b is sealed.
func sealed(b []byte) bool { return FrameFlags(b[2])&FlagEncrypted != 0 }

// routineRecv reads encapsulated packets from the socket of mode mi and
// writes those for this node into TUN queue q; those for a range that
// has moved on are forwarded once more.
func (d *Device) routineRecv(mi int, b conn.Bind, q tun.Queue) error {
	bs := b.BatchSize()
	msgs := make([]conn.Message, bs) // the bind's memory, until the next Recv
	toTUN := make([][]byte, 0, bs)
	var fwd [numWireModes][]conn.Message
	for i := range fwd {
		fwd[i] = make([]conn.Message, 0, bs)
	}
	var t tally
	var from [numDropReasons]netip.Addr // the last source of each drop, for warnDrops
	sc := new(crypt.Scratch)
	enc := d.crypto != nil
	// With encryption, a packet forwarded to a peer that must encrypt
	// needs room for the tag behind it, which a received datagram may
	// not have: such packets are copied into spare.
	var spare *slab
	if enc {
		spare = newSlab(bs, FrameHeaderLen+d.bufSize+AEADTagLen)
	}
	for {
		n, err := b.Recv(msgs)
		if n == 0 && err != nil {
			return d.endErr("receiving "+string(wireModes[mi]), err)
		}
		s := d.snap.Load()
		toTUN = toTUN[:0]
		for i := range fwd {
			fwd[i] = fwd[i][:0]
		}
		var now time.Time
		if enc {
			now = d.now()
			spare.reset()
		}
		for i := range n {
			m := &msgs[i]
			name, ok := s.byAddr[m.Addr.Addr()]
			if !ok {
				t.drop[dropUnknownPeer]++
				from[dropUnknownPeer] = m.Addr.Addr()
				continue
			}
			var inner []byte
			var forwarded bool
			var r dropReason
			if mi == idxUDP {
				var h FrameHeader
				h, inner, r = openFrame(m.Data, s.peers[name], enc, sc, now)
				forwarded = h.Flags&FlagForwarded != 0
			} else if !s.peers[name].plain {
				r = dropPlaintext
			} else {
				inner, r = ipv4Check(m.Data)
				forwarded = m.Mark
			}
			if r != dropNone {
				t.drop[r]++
				from[r] = m.Addr.Addr()
				continue
			}
			if r := s.sourceOK(name, ipv4Src(inner), forwarded, d.cfg.Self); r != dropNone {
				t.drop[r]++
				from[r] = m.Addr.Addr()
				continue
			}
			start := cap(m.Buf) - cap(inner) // where inner starts in Buf
			if start < FrameHeaderLen || start > len(m.Buf) {
				// No room in front of the packet for a header: the
				// binds always leave it (the frame header, the outer IP
				// header, conn.Headroom).
				t.drop[dropMalformed]++
				continue
			}
			owner, ok := s.routes.Owner(ipv4Dst(inner))
			switch {
			case !ok:
				t.drop[dropNoRoute]++
				continue
			case owner == d.cfg.Self:
				toTUN = append(toTUN, m.Buf[start-FrameHeaderLen:start+len(inner)])
				t.count(dirIn, mi, len(inner))
				continue
			case forwarded:
				t.drop[dropForwardLoop]++
				continue
			}
			// The range has moved on (a donation the sender has not heard
			// of): forward once more, marked, as a router would: TTL down.
			p, r := s.sendPath(owner)
			if r == dropNone && !decTTL(inner) {
				r = dropTTL
			}
			if r != dropNone {
				t.drop[r]++
				continue
			}
			fi := p.tunIdx
			buf := m.Buf
			if fi == idxUDP && !p.plain && cap(inner)-len(inner) < AEADTagLen {
				buf = spare.next()
				inner = buf[FrameHeaderLen : FrameHeaderLen+copy(buf[FrameHeaderLen:], inner)]
			}
			fm, r := d.encap(fi, buf, inner, p, true, sc, now)
			if r != dropNone {
				t.drop[r]++
				continue
			}
			fwd[fi] = append(fwd[fi], fm)
		}
		if len(toTUN) > 0 {
			if _, err := q.Write(toTUN, FrameHeaderLen); err != nil {
				if e := d.tunWriteErr(err, &t); e != nil {
					return e
				}
			}
		}
		d.send(fwd[:], dirForward, &t)
		if t.warnable() {
			if now.IsZero() {
				now = d.now()
			}
			d.warnDrops(&t, &from, now)
		}
		d.metrics.flush(&t)
		if err != nil {
			return d.endErr("receiving "+string(wireModes[mi]), err)
		}
	}
}

// tunWriteErr counts the packets the kernel refused; any other error ends
// the routine.
func (d *Device) tunWriteErr(err error, t *tally) error {
	var we *tun.WriteError
	if errors.As(err, &we) {
		t.drop[dropTUNError] += uint64(we.Failed)
		d.log.Debug("tun write refused packets", "err", err)
		return nil
	}
	return d.endErr("writing "+d.tun.Name(), err)
}

// slab is a routine's spare buffers, handed out in turn within a batch.
type slab struct {
	bufs [][]byte
	used int
}

func newSlab(n, size int) *slab {
	mem := make([]byte, n*size)
	s := &slab{bufs: make([][]byte, n)}
	for i := range s.bufs {
		s.bufs[i] = mem[i*size : (i+1)*size : (i+1)*size]
	}
	return s
}

// next hands out a buffer not yet used in this batch; a batch never
// needs more than one per message.
func (s *slab) next() []byte {
	b := s.bufs[s.used%len(s.bufs)]
	s.used++
	return b
}

func (s *slab) reset() { s.used = 0 }

// sourceOK checks the inner source of a packet that peer sent (WireGuard's
// AllowedIPs): it must lie in a range the ring gives that peer, its bridge
// gateway among them. A packet the peer forwards once more for a range that
// moved on (FlagForwarded) comes from a pod of some third peer: its source
// must then lie in a range of a peer other than this node. Anything else is
// a spoofed source: a pod or host that forged it, or a ring not yet in step
// (the drop is counted and warned about).
func (s *snapshot) sourceOK(peer string, src netip.Addr, forwarded bool, self string) dropReason {
	owner, ok := s.routes.Owner(src)
	switch {
	case ok && owner == peer:
		return dropNone
	case forwarded && ok && owner != self:
		return dropNone
	}
	return dropSpoofed
}

// sendPath is how packets for owner leave this node, or why they cannot:
// no such peer, no session key yet, or no encapsulation in common.
func (s *snapshot) sendPath(owner string) (*peerPath, dropReason) {
	p := s.peers[owner]
	switch {
	case p == nil:
		return nil, dropNoPeer
	case p.noKey:
		return nil, dropNoKey
	case p.tunIdx < 0:
		return nil, dropIncompatible
	}
	return p, dropNone
}
