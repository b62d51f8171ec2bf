package ipalloc

import (
	"context"
	"errors"
	"time"
)

// The Service's owner loop, in the shape of raft's node loop: once Run has
// started, every read and change of the core, of the allocations' metadata
// and of the waiters runs on Run's goroutine, one step at a time. A step
// takes every request waiting at that moment (up to maxStep), applies them
// to the core in order (and a tick, when one is due), saves everything the
// core asks to persist in one transaction, and only then sends, answers
// and tells each request how the save went. So 20 allocations that arrive
// together cost one fsync, not 20, and nothing is sent or answered before
// the save of its step committed.
//
// Callers of the local API send a request and wait for its step. Gossip
// (Deliver) and peer joins (AddPeer) come from memberlist's goroutines,
// which must not wait: they are put in the inbox and return at once; a full
// inbox drops them (gossip and the core's retries recover). LocalState
// reads the ring of the last committed step, which the loop publishes.
//
// Before Run starts (Build: the state is loaded and the bridge's addresses
// re-claimed before any goroutine runs) and after it ended (shutdown), a
// call runs as a step of its own on the caller's goroutine: nothing else
// runs then, and s.mu, which a step always holds, keeps it so.

// maxStep bounds the requests of one step: a burst of callers is served
// in steps of at most this many, so that none waits for an unbounded one.
const maxStep = 64

// inboxSize bounds what gossip may queue for the loop.
const inboxSize = 1024

// request is one caller's work for a step: apply runs on the owner before
// the step's save, after (if set) once it is done, with its error.
type request struct {
	apply func()
	after func(saveErr error)
	done  chan struct{}
}

// inbound is what gossip delivered: a decoded message, or a peer the mesh
// sees (msg nil).
type inbound struct {
	from PeerName
	msg  Msg
}

// ErrInboxFull is returned by Deliver when the loop is too far behind to
// take the message; it is dropped (gossip and retries recover it).
var ErrInboxFull = errors.New("ipalloc: inbox full, message dropped")

// call runs apply and then after on the owner as part of one step, and
// returns once both ran. It returns ctx's error, without running them, if
// ctx ends before the loop took the request.
func (s *Service) call(ctx context.Context, apply func(), after func(error)) error {
	req := &request{apply: apply, after: after, done: make(chan struct{})}
	for {
		if !s.running.Load() {
			s.mu.Lock()
			if !s.running.Load() {
				s.stepLocked([]*request{req}, nil, false)
				s.mu.Unlock()
				return nil
			}
			s.mu.Unlock() // the loop started meanwhile
		}
		s.calling.Add(1)
		select {
		case s.reqs <- req:
			s.calling.Add(-1)
			<-req.done // bounded by one step
			return nil
		case <-s.stopped:
			s.calling.Add(-1) // the loop ended meanwhile: run it here
		case <-ctx.Done():
			s.calling.Add(-1)
			return ctx.Err()
		}
	}
}

// update applies fn on the owner and returns the error of its step's save.
func (s *Service) update(fn func()) error {
	var err error
	if cerr := s.call(context.Background(), fn, func(e error) { err = e }); cerr != nil {
		return cerr
	}
	return err
}

// read runs fn on the owner (after a step's save: fn sees what is saved).
func (s *Service) read(fn func()) {
	_ = s.call(context.Background(), fn, nil)
}

// stepLocked is one step of the owner: the requests, the inbound gossip, a
// tick, one save, then the answers.
func (s *Service) stepLocked(reqs []*request, in []inbound, tick bool) {
	for _, m := range in {
		s.applyInbound(m)
	}
	for _, r := range reqs {
		if r.apply != nil {
			r.apply()
		}
	}
	if tick {
		s.p.Tick()
	}
	err := s.flushLocked()
	if err != nil && len(reqs) == 0 {
		s.log.Error("ipalloc: step", "err", err)
	}
	for _, r := range reqs {
		if r.after != nil {
			r.after(err)
		}
		close(r.done)
	}
}

// applyInbound steps the core with what gossip delivered; the core's
// refusals are its own to log.
func (s *Service) applyInbound(m inbound) {
	if m.msg == nil {
		s.p.AddPeer(m.from)
		return
	}
	err := s.p.Step(m.from, m.msg)
	var refused *RefusedRing
	if err != nil && !errors.Is(err, ErrRemovedPeer) && !errors.As(err, &refused) {
		s.log.Warn("ipalloc: refused a message", "from", m.from, "err", err)
	}
}

// enqueue puts m in the inbox without waiting, or applies it at once when
// no loop runs.
func (s *Service) enqueue(m inbound) error {
	if !s.running.Load() {
		s.mu.Lock()
		if !s.running.Load() {
			defer s.mu.Unlock()
			s.applyInbound(m)
			return s.flushLocked()
		}
		s.mu.Unlock()
	}
	select {
	case s.inbox <- m:
		return nil
	default:
		s.dropped.Add(1)
		return ErrInboxFull
	}
}

// Deliver takes a message from another peer as gossip does: it is decoded
// (a bad one is refused here, with the error) and queued for the loop, and
// Deliver returns at once. See Step for a caller that waits.
func (s *Service) Deliver(from PeerName, data []byte) error {
	m, err := DecodeMsg(data)
	if err != nil {
		return err
	}
	return s.enqueue(inbound{from: from, msg: m})
}

// Dropped counts the gossip messages and peer joins dropped on a full inbox.
func (s *Service) Dropped() uint64 { return s.dropped.Load() }

// Run is the owner loop (see above): it steps the core on requests,
// gossip and ticks, and sends its messages through tr until ctx ends. tr
// may be nil for a peer without a mesh. Call it once.
func (s *Service) Run(ctx context.Context, tr Transport) {
	s.mu.Lock()
	s.tr = tr
	s.running.Store(true)
	s.mu.Unlock()
	sendCtx, stopSend := context.WithCancel(ctx)
	sent := make(chan struct{})
	if tr != nil {
		go func() { defer close(sent); s.routineSend(sendCtx, tr) }()
	} else {
		close(sent)
	}
	defer func() {
		stopSend()
		<-sent
		s.mu.Lock()
		s.running.Store(false)
		s.tr = nil
		close(s.stopped)
		s.mu.Unlock()
	}()
	t := time.NewTicker(TickInterval)
	defer t.Stop()
	var reqs []*request
	var in []inbound
	for {
		reqs, in = reqs[:0], in[:0]
		tick := false
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			tick = true
		case r := <-s.reqs:
			reqs = append(reqs, r)
		case m := <-s.inbox:
			in = append(in, m)
		}
	take:
		for len(reqs) < maxStep {
			select {
			case r := <-s.reqs:
				reqs = append(reqs, r)
			case m := <-s.inbox:
				in = append(in, m)
			default:
				break take
			}
		}
		s.mu.Lock()
		s.stepLocked(reqs, in, tick)
		s.mu.Unlock()
	}
}
