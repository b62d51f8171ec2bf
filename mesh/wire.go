package mesh

import (
	"encoding/binary"
	"errors"
	"fmt"
)

// Size limits of channel data. A broadcast rides in one UDP gossip packet
// (memberlist packs up to 1400 bytes), so its payload is kept well below;
// a unicast and the push-pull state go over TCP.
const (
	MaxBroadcastSize = 1024    // payload of one Channel.Broadcast
	MaxMessageSize   = 1 << 20 // payload of one Channel.SendTo
	MaxStateSize     = 3 << 20 // all channels' LocalState together, framed: with memberlist's node states it must fit in PreAuthLimits.MaxStreamSize (a 1000-peer ring is 16 KB)
	MaxChannelName   = 32      // bytes of a channel name
	maxChannels      = 64      // channels in one state frame
)

// wireVersion is the version of the framing below. A peer drops frames
// of another version (counted as "version") rather than misreading them.
const wireVersion = 1

// Frame kinds.
const (
	kindBroadcast byte = 1
	kindUnicast   byte = 2
	kindState     byte = 3
)

// Why a frame from a peer was dropped. errors.Is on a decode error finds one
// of these; dropReason turns it into the metric label.
var (
	ErrTruncated = errors.New("truncated")
	ErrOversized = errors.New("oversized")
	ErrMalformed = errors.New("malformed")
	ErrVersion   = errors.New("unsupported wire version")
)

// Drop reasons, the values of the dropped-messages metric's label.
const (
	reasonTruncated = "truncated"
	reasonOversized = "oversized"
	reasonMalformed = "malformed"
	reasonVersion   = "version"
	reasonUnknown   = "unknown-channel"
	reasonRejected  = "rejected"   // the channel's Gossiper returned an error
	reasonQueueFull = "queue-full" // an outgoing broadcast was pruned from a full queue
	reasonTooLarge  = "relay-too-large"
)

func dropReason(err error) string {
	switch {
	case errors.Is(err, ErrTruncated):
		return reasonTruncated
	case errors.Is(err, ErrOversized):
		return reasonOversized
	case errors.Is(err, ErrVersion):
		return reasonVersion
	}
	return reasonMalformed
}

// message is one decoded broadcast or unicast frame.
type message struct {
	kind    byte
	channel string
	from    PeerName
	payload []byte
}

// encodeMessage frames a broadcast or unicast:
//
//	version:1 kind:1 channelLen:1 channel fromLen:1 from payloadLen:uvarint payload
func encodeMessage(kind byte, channel string, from PeerName, payload []byte) []byte {
	b := make([]byte, 0, 4+len(channel)+len(from)+binary.MaxVarintLen64+len(payload))
	b = append(b, wireVersion, kind)
	b = appendShort(b, []byte(channel))
	b = appendShort(b, []byte(from))
	b = binary.AppendUvarint(b, uint64(len(payload)))
	return append(b, payload...)
}

// decodeMessage decodes and validates a frame from a peer. The payload
// aliases b. It never panics.
func decodeMessage(b []byte) (message, error) {
	var m message
	if len(b) < 2 {
		return m, fmt.Errorf("%w: %d bytes", ErrTruncated, len(b))
	}
	if b[0] != wireVersion {
		return m, fmt.Errorf("%w %d", ErrVersion, b[0])
	}
	m.kind = b[1]
	limit := uint64(MaxMessageSize)
	switch m.kind {
	case kindBroadcast:
		limit = MaxBroadcastSize
	case kindUnicast:
	default:
		return m, fmt.Errorf("%w: frame kind %d", ErrMalformed, m.kind)
	}
	r := reader{b: b[2:]}
	m.channel = string(r.short())
	m.from = PeerName(r.short())
	n := r.uvarint(limit)
	m.payload = r.take(int(n))
	if r.err != nil {
		return message{}, r.err
	}
	if len(r.b) > 0 {
		return message{}, fmt.Errorf("%w: %d trailing bytes", ErrMalformed, len(r.b))
	}
	if err := validChannelName(m.channel); err != nil {
		return message{}, fmt.Errorf("%w: %v", ErrMalformed, err)
	}
	if err := ValidateName(m.from); err != nil {
		return message{}, fmt.Errorf("%w: sender: %v", ErrMalformed, err)
	}
	return m, nil
}

// validChannelName accepts 1 to MaxChannelName bytes of [a-z0-9._-].
func validChannelName(s string) error {
	if s == "" || len(s) > MaxChannelName {
		return fmt.Errorf("channel name %q: give 1 to %d characters", s, MaxChannelName)
	}
	for _, r := range s {
		if !(r >= 'a' && r <= 'z' || r >= '0' && r <= '9' || r == '.' || r == '_' || r == '-') {
			return fmt.Errorf("channel name %q: only a-z, 0-9, '.', '_' and '-'", s)
		}
	}
	return nil
}

// channelState is one channel's part of a push-pull state frame.
type channelState struct {
	channel string
	data    []byte
}

// encodeState frames every channel's state for a push-pull:
//
//	version:1 kind:1 count:uvarint (channelLen:1 channel dataLen:uvarint data)*
func encodeState(parts []channelState) []byte {
	size := 2 + binary.MaxVarintLen64
	for _, p := range parts {
		size += 1 + len(p.channel) + binary.MaxVarintLen64 + len(p.data)
	}
	b := make([]byte, 0, size)
	b = append(b, wireVersion, kindState)
	b = binary.AppendUvarint(b, uint64(len(parts)))
	for _, p := range parts {
		b = appendShort(b, []byte(p.channel))
		b = binary.AppendUvarint(b, uint64(len(p.data)))
		b = append(b, p.data...)
	}
	return b
}

// decodeState decodes and validates a push-pull state frame from a peer.
// The data alias b. It never panics.
func decodeState(b []byte) ([]channelState, error) {
	if len(b) > MaxStateSize {
		return nil, fmt.Errorf("%w: state of %d bytes, limit %d", ErrOversized, len(b), MaxStateSize)
	}
	if len(b) < 2 {
		return nil, fmt.Errorf("%w: %d bytes", ErrTruncated, len(b))
	}
	if b[0] != wireVersion {
		return nil, fmt.Errorf("%w %d", ErrVersion, b[0])
	}
	if b[1] != kindState {
		return nil, fmt.Errorf("%w: frame kind %d, want state", ErrMalformed, b[1])
	}
	r := reader{b: b[2:]}
	n := r.uvarint(maxChannels)
	if r.err != nil {
		return nil, r.err
	}
	parts := make([]channelState, 0, n)
	seen := make(map[string]bool, n)
	for i := uint64(0); i < n; i++ {
		name := string(r.short())
		data := r.take(int(r.uvarint(MaxStateSize)))
		if r.err != nil {
			return nil, r.err
		}
		if err := validChannelName(name); err != nil {
			return nil, fmt.Errorf("%w: %v", ErrMalformed, err)
		}
		if seen[name] {
			return nil, fmt.Errorf("%w: channel %q twice", ErrMalformed, name)
		}
		seen[name] = true
		parts = append(parts, channelState{channel: name, data: data})
	}
	if len(r.b) > 0 {
		return nil, fmt.Errorf("%w: %d trailing bytes", ErrMalformed, len(r.b))
	}
	return parts, nil
}

// report is what one peer says about the others on the internal topology
// channel: which peers it cannot reach (usually none, so the record stays
// small however large the cluster), and whether it is leaving. Version
// orders a peer's reports, across its restarts too (it starts from the
// wall clock).
type report struct {
	Origin      PeerName
	Version     uint64
	Leaving     bool
	Unreachable []PeerName
}

const (
	reportVersion  = 1
	maxUnreachable = 4096 // names in one report
	maxReports     = 1 << 16
)

// encodeReport frames a report:
//
//	version:1 originLen:1 origin version:uvarint flags:1 count:uvarint (len:1 name)*
func encodeReport(r report) []byte {
	b := []byte{reportVersion}
	b = appendShort(b, []byte(r.Origin))
	b = binary.AppendUvarint(b, r.Version)
	var flags byte
	if r.Leaving {
		flags |= 1
	}
	b = append(b, flags)
	b = binary.AppendUvarint(b, uint64(len(r.Unreachable)))
	for _, n := range r.Unreachable {
		b = appendShort(b, []byte(n))
	}
	return b
}

// decodeReport decodes and validates a report from a peer. It never panics.
func decodeReport(b []byte) (report, error) {
	var rep report
	if len(b) == 0 {
		return rep, ErrTruncated
	}
	if b[0] != reportVersion {
		return rep, fmt.Errorf("%w %d of a topology report", ErrVersion, b[0])
	}
	r := reader{b: b[1:]}
	rep.Origin = PeerName(r.short())
	rep.Version = r.uvarint(^uint64(0))
	flags := r.byte()
	n := r.uvarint(maxUnreachable)
	if r.err != nil {
		return report{}, r.err
	}
	if flags&^1 != 0 {
		return report{}, fmt.Errorf("%w: unknown report flags %#x", ErrMalformed, flags)
	}
	rep.Leaving = flags&1 != 0
	for i := uint64(0); i < n; i++ {
		name := PeerName(r.short())
		if r.err != nil {
			return report{}, r.err
		}
		if err := ValidateName(name); err != nil {
			return report{}, fmt.Errorf("%w: %v", ErrMalformed, err)
		}
		rep.Unreachable = append(rep.Unreachable, name)
	}
	if len(r.b) > 0 {
		return report{}, fmt.Errorf("%w: %d trailing bytes", ErrMalformed, len(r.b))
	}
	if err := ValidateName(rep.Origin); err != nil {
		return report{}, fmt.Errorf("%w: report origin: %v", ErrMalformed, err)
	}
	return rep, nil
}

// encodeReports is the topology channel's push-pull state: count:uvarint
// then each report as len:uvarint report.
func encodeReports(reps []report) []byte {
	b := binary.AppendUvarint(nil, uint64(len(reps)))
	for _, rep := range reps {
		e := encodeReport(rep)
		b = binary.AppendUvarint(b, uint64(len(e)))
		b = append(b, e...)
	}
	return b
}

// decodeReports decodes the topology channel's state. It never panics.
func decodeReports(b []byte) ([]report, error) {
	r := reader{b: b}
	n := r.uvarint(maxReports)
	if r.err != nil {
		return nil, r.err
	}
	var reps []report
	for i := uint64(0); i < n; i++ {
		e := r.take(int(r.uvarint(uint64(len(r.b)))))
		if r.err != nil {
			return nil, r.err
		}
		rep, err := decodeReport(e)
		if err != nil {
			return nil, err
		}
		reps = append(reps, rep)
	}
	if len(r.b) > 0 {
		return nil, fmt.Errorf("%w: %d trailing bytes", ErrMalformed, len(r.b))
	}
	return reps, nil
}
