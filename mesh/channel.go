package mesh

import (
	"bytes"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"

	"github.com/hashicorp/memberlist"
)

// Gossiper is what a package plugs into a gossip channel, in the spirit of
// weaveworks/mesh's Gossiper. The mesh calls it from memberlist's
// goroutines, concurrently: its methods must be safe for that, quick, and
// must not block on the network (call SendTo from another goroutine).
// Everything it receives comes from other peers and must be validated; an
// error return drops the message (counted as "rejected"), never the peer.
//
// Data passed in belongs to the Gossiper (it is a copy). A message's from
// is the peer that sent it: for a broadcast, the originator or a peer
// relaying what was new to it. With a password only a peer that has it gets
// a message through (see Config.SecretKey), but from is what that peer
// says: any member can claim any name. Without a password, anyone who
// reaches the gossip port can.
type Gossiper interface {
	// OnBroadcast merges a delta a peer broadcast and returns the part
	// that was new here, or nil when nothing was. The mesh re-broadcasts
	// what is returned: memberlist sends a broadcast to only about
	// RetransmitMult*log10(N) peers, so relaying the news is what makes it
	// reach all N quickly (epidemically); returning nil once nothing is
	// new is what ends the relay.
	OnBroadcast(from PeerName, data []byte) (news []byte, err error)
	// OnUnicast handles a reliable direct message sent with SendTo.
	OnUnicast(from PeerName, data []byte) error
	// LocalState returns the complete state, sent to a peer on each
	// push-pull (every PushPullInterval, and when a peer joins).
	LocalState() []byte
	// MergeRemoteState merges a peer's complete state. To spread what was
	// new faster than push-pull does, the Gossiper may Broadcast it.
	MergeRemoteState(data []byte) error
}

// Channel is a named gossip channel; its name is in every message.
type Channel struct {
	m    *Mesh
	name string
	g    Gossiper
}

// Channel registers a gossip channel. Register every channel before Start:
// a push-pull carries all channels' state, and messages for a channel this
// peer does not know are dropped. Names are 1 to 32 characters of
// a-z, 0-9, '.', '_' and '-', starting with a letter.
func (m *Mesh) Channel(name string, g Gossiper) (*Channel, error) {
	if err := validChannelName(name); err != nil {
		return nil, err
	}
	if c := name[0]; c < 'a' || c > 'z' {
		return nil, fmt.Errorf("channel name %q: must start with a letter", name)
	}
	if g == nil {
		return nil, fmt.Errorf("channel %q: nil Gossiper", name)
	}
	m.chMu.Lock()
	defer m.chMu.Unlock()
	if m.started {
		return nil, fmt.Errorf("channel %q: %w; register channels before Start", name, ErrStarted)
	}
	if _, ok := m.channels[name]; ok {
		return nil, fmt.Errorf("channel %q is already registered", name)
	}
	c := &Channel{m: m, name: name, g: g}
	m.channels[name] = c
	return c, nil
}

// Name is the channel's name.
func (c *Channel) Name() string { return c.name }

// Broadcast queues data for gossip to every peer: memberlist piggybacks it
// on its gossip packets (TransmitLimitedQueue), each peer relays what was
// new to it (see Gossiper.OnBroadcast). It never blocks. Data larger than
// MaxBroadcastSize is refused with ErrTooLarge: send big state through
// LocalState (push-pull) or SendTo. A broadcast queued before Start goes
// out once started.
func (c *Channel) Broadcast(data []byte) error {
	if len(data) > MaxBroadcastSize {
		return fmt.Errorf("broadcast on channel %q: %w: %d bytes, limit %d; send big state through LocalState or SendTo", c.name, ErrTooLarge, len(data), MaxBroadcastSize)
	}
	if c.m.closed.Load() {
		return ErrClosed
	}
	c.m.enqueue(&uniqueBroadcast{msg: encodeMessage(kindBroadcast, c.name, c.m.cfg.Name, data)})
	return nil
}

// SendTo sends data to one peer over a stream (reliable, memberlist's
// SendReliable); the peer's Gossiper gets it in OnUnicast. It blocks until
// sent, at most TCPTimeout. Peers this one sees unreachable or left are
// refused with ErrPeerUnreachable without trying.
func (c *Channel) SendTo(peer PeerName, data []byte) error {
	m := c.m
	if len(data) > MaxMessageSize {
		return fmt.Errorf("sending to %s on channel %q: %w: %d bytes, limit %d", peer, c.name, ErrTooLarge, len(data), MaxMessageSize)
	}
	if m.closed.Load() {
		return ErrClosed
	}
	ml := m.ml.Load()
	if ml == nil {
		return ErrNotStarted
	}
	if peer == m.cfg.Name {
		return fmt.Errorf("sending on channel %q: %s is this peer", c.name, peer)
	}
	p, ok := m.Peer(peer)
	switch {
	case !ok:
		return fmt.Errorf("sending to %s on channel %q: %w", peer, c.name, ErrUnknownPeer)
	case p.State == StateUnreachable || p.State == StateLeft:
		return fmt.Errorf("sending to %s on channel %q: %w (%s since %s)", peer, c.name, ErrPeerUnreachable, p.State, p.Since.Format("15:04:05"))
	}
	node := &memberlist.Node{Name: string(peer), Addr: p.Addr.Addr().AsSlice(), Port: p.Addr.Port()}
	if err := ml.SendReliable(node, encodeMessage(kindUnicast, c.name, m.cfg.Name, data)); err != nil {
		return fmt.Errorf("sending to %s at %s on channel %q: %w", peer, p.Addr, c.name, err)
	}
	m.metrics.count(c.name, "out", "unicast", len(data))
	return nil
}

// uniqueBroadcast is a channel broadcast: never invalidated by another.
type uniqueBroadcast struct{ msg []byte }

func (b *uniqueBroadcast) Invalidates(memberlist.Broadcast) bool { return false }
func (b *uniqueBroadcast) Message() []byte                       { return b.msg }
func (b *uniqueBroadcast) Finished()                             {}
func (b *uniqueBroadcast) UniqueBroadcast()                      {}

// namedBroadcast replaces any queued broadcast of the same name: a newer
// report of a peer supersedes the older one. A non-nil done is closed when
// the broadcast has been sent as often as it will be (or was superseded).
type namedBroadcast struct {
	name string
	msg  []byte
	done chan struct{}
	once sync.Once
}

func (b *namedBroadcast) Invalidates(o memberlist.Broadcast) bool {
	nb, ok := o.(memberlist.NamedBroadcast)
	return ok && nb.Name() == b.name
}
func (b *namedBroadcast) Message() []byte { return b.msg }
func (b *namedBroadcast) Finished() {
	if b.done != nil {
		b.once.Do(func() { close(b.done) })
	}
}
func (b *namedBroadcast) Name() string { return b.name }

func (m *Mesh) channel(name string) *Channel {
	m.chMu.RLock()
	defer m.chMu.RUnlock()
	return m.channels[name]
}

// handleMessage takes a broadcast or unicast frame from a peer. Whatever is
// wrong with it, it is dropped and counted, never a panic.
func (m *Mesh) handleMessage(b []byte) {
	if m.closed.Load() {
		return
	}
	msg, err := decodeMessage(b)
	if err != nil {
		m.dropped(dropReason(err), "", err)
		return
	}
	c := m.channel(msg.channel)
	if c == nil {
		m.dropped(reasonUnknown, "", fmt.Errorf("message from %s for channel %q, which this peer does not have", msg.from, msg.channel))
		return
	}
	data := bytes.Clone(msg.payload)
	switch msg.kind {
	case kindBroadcast:
		m.metrics.count(c.name, "in", "broadcast", len(data))
		news, err := c.g.OnBroadcast(msg.from, data)
		if err != nil {
			m.dropped(reasonRejected, c.name, fmt.Errorf("broadcast from %s: %w", msg.from, err))
			return
		}
		if len(news) == 0 {
			return
		}
		if err := c.relay(news); err != nil {
			m.dropped(reasonTooLarge, c.name, err)
		}
	case kindUnicast:
		m.metrics.count(c.name, "in", "unicast", len(data))
		if err := c.g.OnUnicast(msg.from, data); err != nil {
			m.dropped(reasonRejected, c.name, fmt.Errorf("unicast from %s: %w", msg.from, err))
		}
	}
}

// relay re-broadcasts what a broadcast taught us; the topology channel's
// news (a goodbye) keeps its origin, so it invalidates older reports.
func (c *Channel) relay(news []byte) error {
	if len(news) > MaxBroadcastSize {
		return fmt.Errorf("news of %d bytes is over the broadcast limit %d; push-pull will carry it", len(news), MaxBroadcastSize)
	}
	if c.name == topologyChannel {
		rep, err := decodeReport(news)
		if err != nil {
			return err
		}
		c.m.enqueue(&namedBroadcast{
			name: topologyChannel + "/" + string(rep.Origin),
			msg:  encodeMessage(kindBroadcast, topologyChannel, c.m.cfg.Name, news),
		})
		return nil
	}
	c.m.enqueue(&uniqueBroadcast{msg: encodeMessage(kindBroadcast, c.name, c.m.cfg.Name, news)})
	return nil
}

// localState frames every channel's state for a push-pull, leaving out a
// channel whose state would overflow MaxStateSize (logged).
func (m *Mesh) localState() []byte {
	if m.closed.Load() {
		return nil
	}
	m.chMu.RLock()
	chans := make([]*Channel, 0, len(m.channels))
	for _, c := range m.channels {
		chans = append(chans, c)
	}
	m.chMu.RUnlock()
	slices.SortFunc(chans, func(a, b *Channel) int { return strings.Compare(a.name, b.name) })
	var parts []channelState
	size := 16
	for _, c := range chans {
		data := c.g.LocalState()
		if size+len(data)+16+len(c.name) > MaxStateSize {
			m.log.Error("a channel's state is too large for a push-pull and is not sent; its peers converge only through broadcasts", "channel", c.name, "bytes", len(data), "limit", MaxStateSize)
			continue
		}
		size += len(data) + 16 + len(c.name)
		parts = append(parts, channelState{channel: c.name, data: data})
		m.metrics.count(c.name, "out", "state", len(data))
	}
	return encodeState(parts)
}

// mergeState takes a push-pull state frame from a peer.
func (m *Mesh) mergeState(b []byte) {
	if m.closed.Load() || len(b) == 0 {
		return
	}
	parts, err := decodeState(b)
	if err != nil {
		m.dropped(dropReason(err), "", fmt.Errorf("push-pull state: %w", err))
		return
	}
	for _, p := range parts {
		c := m.channel(p.channel)
		if c == nil {
			m.dropped(reasonUnknown, "", fmt.Errorf("push-pull state for channel %q, which this peer does not have", p.channel))
			continue
		}
		m.metrics.count(c.name, "in", "state", len(p.data))
		if err := c.g.MergeRemoteState(p.data); err != nil {
			m.dropped(reasonRejected, c.name, fmt.Errorf("push-pull state: %w", err))
		}
	}
}

// topologyGossiper is the internal channel of peers' reports.
type topologyGossiper Mesh

func (t *topologyGossiper) OnBroadcast(_ PeerName, data []byte) ([]byte, error) {
	rep, err := decodeReport(data)
	if err != nil {
		return nil, err
	}
	// Only a goodbye is relayed: the others' reports reach everyone by
	// push-pull, and relaying each would cost O(N^2) when a peer fails.
	if (*Mesh)(t).applyReport(rep) && rep.Leaving {
		return data, nil
	}
	return nil, nil
}

func (t *topologyGossiper) OnUnicast(PeerName, []byte) error {
	return errors.New("the topology channel takes no unicasts")
}

func (t *topologyGossiper) LocalState() []byte {
	m := (*Mesh)(t)
	m.mu.Lock()
	reps := make([]report, 0, len(m.reports)+1)
	reps = append(reps, m.ownReport)
	for _, r := range m.reports {
		reps = append(reps, r)
	}
	m.mu.Unlock()
	return encodeReports(reps)
}

func (t *topologyGossiper) MergeRemoteState(data []byte) error {
	reps, err := decodeReports(data)
	if err != nil {
		return err
	}
	(*Mesh)(t).applyReports(reps)
	return nil
}

// delegate is memberlist's view of the mesh: its Delegate, EventDelegate
// and ConflictDelegate. Memberlist calls the events with its node lock
// held, so they must not call back into memberlist.
type delegate struct{ m *Mesh }

func (d *delegate) NodeMeta(int) []byte               { return d.m.meta }
func (d *delegate) NotifyMsg(b []byte)                { d.m.handleMessage(b) }
func (d *delegate) LocalState(bool) []byte            { return d.m.localState() }
func (d *delegate) MergeRemoteState(b []byte, _ bool) { d.m.mergeState(b) }

func (d *delegate) GetBroadcasts(overhead, limit int) [][]byte {
	msgs := d.m.queue.GetBroadcasts(overhead, limit)
	for _, b := range msgs {
		if msg, err := decodeMessage(b); err == nil {
			d.m.metrics.count(msg.channel, "out", "broadcast", len(msg.payload))
		}
	}
	return msgs
}

func (d *delegate) NotifyJoin(n *memberlist.Node) {
	d.m.onAlive(PeerName(n.Name), nodeAddr(n), n.Meta)
}

func (d *delegate) NotifyUpdate(n *memberlist.Node) {
	d.m.onAlive(PeerName(n.Name), nodeAddr(n), n.Meta)
}

func (d *delegate) NotifyLeave(n *memberlist.Node) { d.m.onDead(PeerName(n.Name)) }

// NotifyConflict is memberlist telling that a live peer claims a name
// another live peer has. Both keep running; the newcomer is ignored by the
// peers that knew the first.
func (d *delegate) NotifyConflict(existing, other *memberlist.Node) {
	m := d.m
	m.metrics.conflicts.Inc()
	ea, oa := nodeAddr(existing), nodeAddr(other)
	if _, ok := m.drops.allow("conflict/"+ea.String()+"/"+oa.String(), m.now()); !ok {
		return
	}
	if PeerName(existing.Name) == m.cfg.Name {
		m.log.Error(fmt.Sprintf("another peer claims this peer's name %s: this peer is at %s, the other at %s; give one of them another --name (or remove its state dir so that it picks a new random name)", existing.Name, ea, oa),
			"name", existing.Name, "ours", ea, "theirs", oa)
		return
	}
	m.log.Error(fmt.Sprintf("two peers claim the name %s: %s (known) and %s (ignored); give one of them another --name", existing.Name, ea, oa),
		"name", existing.Name, "known", ea, "other", oa)
}
