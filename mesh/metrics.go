package mesh

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/weft-net/weft/internal/promreg"
)

// metrics are the mesh's Prometheus collectors. They always exist (tests
// read them); they are registered only when Config.Registerer is set.
type metrics struct {
	peers     *prometheus.GaugeVec   // state
	messages  *prometheus.CounterVec // channel, direction, kind
	bytes     *prometheus.CounterVec // channel, direction, kind
	dropped   *prometheus.CounterVec // reason
	conflicts prometheus.Counter
	badMeta   prometheus.Counter
	joins     *prometheus.CounterVec // result

	authFailures   prometheus.Counter
	preAuthRefused *prometheus.CounterVec // reason
	refusedBy      map[string]prometheus.Counter
}

// refusedCounter is preAuthRefused's counter of a reason, looked up once.
func (m *metrics) refusedCounter(reason string) prometheus.Counter {
	if c, ok := m.refusedBy[reason]; ok {
		return c
	}
	return m.preAuthRefused.WithLabelValues(reason)
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		peers: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "weft_mesh_peers", Help: "Peers this peer knows (itself included), by state.",
		}, []string{"state"}),
		messages: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "weft_mesh_gossip_messages_total",
			Help: "Gossip channel messages by channel, direction (in, out) and kind (broadcast, unicast, state).",
		}, []string{"channel", "direction", "kind"}),
		bytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "weft_mesh_gossip_bytes_total",
			Help: "Gossip channel payload bytes by channel, direction (in, out) and kind (broadcast, unicast, state).",
		}, []string{"channel", "direction", "kind"}),
		dropped: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "weft_mesh_dropped_messages_total",
			Help: "Gossip messages dropped, by reason (malformed, truncated, oversized, version, unknown-channel, rejected, queue-full, relay-too-large).",
		}, []string{"reason"}),
		conflicts: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "weft_mesh_name_conflicts_total",
			Help: "Times a live peer was seen claiming a name another peer has.",
		}),
		badMeta: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "weft_mesh_invalid_metadata_total",
			Help: "Peer metadata records that failed to decode, and component blobs in them that were refused.",
		}),
		joins: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "weft_mesh_join_attempts_total",
			Help: "Attempts to join a target address, by result (ok, failed, unresolvable).",
		}, []string{"result"}),
		authFailures: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "weft_mesh_auth_failures_total",
			Help: "Gossip packets and streams refused because they were not encrypted with this peer's key: a peer with no or another password.",
		}),
		preAuthRefused: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "weft_mesh_preauth_refused_total",
			Help: "Gossip packets and streams refused before memberlist saw them, by reason (label, empty, plaintext, auth, too-large, busy, truncated, over-limit).",
		}, []string{"reason"}),
	}
	m.refusedBy = map[string]prometheus.Counter{}
	for _, r := range refusedReasons {
		m.refusedBy[r] = m.preAuthRefused.WithLabelValues(r)
	}
	for _, s := range []PeerState{StateAlive, StateSuspect, StateUnreachable, StateLeft} {
		m.peers.WithLabelValues(s.String())
	}
	for _, r := range []string{reasonTruncated, reasonOversized, reasonMalformed, reasonVersion, reasonUnknown, reasonRejected, reasonQueueFull, reasonTooLarge} {
		m.dropped.WithLabelValues(r)
	}
	if err := promreg.Register(reg, m.collectors()...); err != nil {
		return nil, err
	}
	return m, nil
}

func (m *metrics) count(channel, direction, kind string, n int) {
	m.messages.WithLabelValues(channel, direction, kind).Inc()
	m.bytes.WithLabelValues(channel, direction, kind).Add(float64(n))
}

func (m *metrics) unregister(reg prometheus.Registerer) {
	if reg == nil {
		return
	}
	for _, c := range m.collectors() {
		reg.Unregister(c)
	}
}

func (m *metrics) collectors() []prometheus.Collector {
	return []prometheus.Collector{m.peers, m.messages, m.bytes, m.dropped, m.conflicts, m.badMeta, m.joins, m.authFailures, m.preAuthRefused}
}
