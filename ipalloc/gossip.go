package ipalloc

import (
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"
)

// Gossip adapts a Service to a gossip channel of the mesh (the router
// plugs it in, converting the peer names: ipalloc does not import the
// mesh). Every callback returns at once: messages are decoded and queued
// for the Service's owner loop (Service.Deliver), and the full state
// offered is the ring of the last committed step.
//
// Broadcasts and unicasts are the core's messages as EncodeMsg makes them
// (they start with their own format byte). A full-state exchange
// (memberlist's push-pull) carries no sender, so the state is framed with
// this peer's name, which the core needs to refuse removed peers:
//
//	frame v1 = 0xFF version(1 byte, 1) name msg
//	frame v0 = name msg           (weft up to 8aaa770: still read)
//	name     = len(uvarint, 1..64) bytes
//
// A v0 frame starts with its name's length, 1..64, so it never starts
// with 0xFF. A frame of an unknown version (a newer weft) is refused with
// an UnknownFrameError, counted (Refused), and logged at most once per
// GossipLogEvery.
type Gossip struct {
	svc *Service
	log *slog.Logger
	now func() time.Time

	refused atomic.Uint64

	mu         sync.Mutex
	lastLog    time.Time
	suppressed int
}

const (
	stateFrameTag     = 0xFF
	stateFrameVersion = 1
)

// GossipLogEvery bounds how often Gossip logs refused frames.
const GossipLogEvery = time.Minute

// UnknownFrameError is a push-pull state frame of a version this weft does
// not read.
type UnknownFrameError struct{ Version byte }

func (e *UnknownFrameError) Error() string {
	return fmt.Sprintf("ipam state frame of version %d, this weft reads up to %d (a newer weft sent it: upgrade this node)", e.Version, stateFrameVersion)
}

// NewGossip returns the adapter of svc; now is the clock of its log
// limit (nil: time.Now).
func NewGossip(svc *Service, log *slog.Logger, now func() time.Time) *Gossip {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if now == nil {
		now = time.Now
	}
	return &Gossip{svc: svc, log: log, now: now}
}

// Refused counts the frames and messages refused as of an unknown version.
func (g *Gossip) Refused() uint64 { return g.refused.Load() }

// OnBroadcast takes a message a peer broadcast. The core re-broadcasts
// what changed through its Ready, so there is nothing to relay.
func (g *Gossip) OnBroadcast(from PeerName, data []byte) error {
	return g.deliver(from, data)
}

// OnUnicast takes a message a peer sent to this one.
func (g *Gossip) OnUnicast(from PeerName, data []byte) error {
	return g.deliver(from, data)
}

func (g *Gossip) deliver(from PeerName, data []byte) error {
	err := g.svc.Deliver(from, data)
	if len(data) > 0 && data[0] != wireFormat && errors.Is(err, ErrBadMessage) {
		g.refuse(from, err)
	}
	return err
}

// LocalState is this peer's full state for a push-pull, framed (v1).
func (g *Gossip) LocalState() []byte {
	return AppendStateFrame(nil, g.svc.cfg.Self, g.svc.LocalState())
}

// MergeRemoteState takes a peer's full state.
func (g *Gossip) MergeRemoteState(data []byte) error {
	from, msg, err := DecodeStateFrame(data)
	if err != nil {
		var unknown *UnknownFrameError
		if errors.As(err, &unknown) {
			g.refuse("", err)
		}
		return err
	}
	return g.deliver(from, msg)
}

// refuse counts err and logs it, at most once per GossipLogEvery.
func (g *Gossip) refuse(from PeerName, err error) {
	g.refused.Add(1)
	g.mu.Lock()
	defer g.mu.Unlock()
	now := g.now()
	if !g.lastLog.IsZero() && now.Sub(g.lastLog) < GossipLogEvery {
		g.suppressed++
		return
	}
	g.log.Warn("ipalloc: refused gossip of another weft version; are all peers running the same weft version?",
		"from", from, "err", err, "refused-since-last-log", g.suppressed)
	g.lastLog, g.suppressed = now, 0
}

// AppendStateFrame appends the v1 frame of a full state (msg, from
// Service.LocalState) sent by self.
func AppendStateFrame(b []byte, self PeerName, msg []byte) []byte {
	b = append(b, stateFrameTag, stateFrameVersion)
	b = binary.AppendUvarint(b, uint64(len(self)))
	b = append(b, self...)
	return append(b, msg...)
}

// DecodeStateFrame splits a full-state frame (v1 or v0) into its sender
// and its message (not decoded: Service.Deliver does).
func DecodeStateFrame(data []byte) (PeerName, []byte, error) {
	if len(data) > 0 && data[0] == stateFrameTag {
		if len(data) < 2 {
			return "", nil, fmt.Errorf("%w: ipam state frame: no version", ErrBadMessage)
		}
		if data[1] != stateFrameVersion {
			return "", nil, fmt.Errorf("%w: %w", ErrBadMessage, &UnknownFrameError{Version: data[1]})
		}
		data = data[2:]
	}
	n, k := binary.Uvarint(data)
	if k <= 0 || n == 0 || n > MaxPeerNameLen || uint64(len(data)-k) < n {
		return "", nil, fmt.Errorf("%w: ipam state frame: bad sender name", ErrBadMessage)
	}
	from := PeerName(data[k : k+int(n)])
	if err := ValidatePeerName(from); err != nil {
		return "", nil, fmt.Errorf("%w: ipam state frame: %w", ErrBadMessage, err)
	}
	return from, data[k+int(n):], nil
}
