package tunnel

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/weft-net/weft/internal/promreg"
)

// dropReason is why a packet was dropped; each has a counter.
type dropReason int

// Drop reasons. Frames from the underlay that fail a check are dropped
// and counted, never forwarded.
const (
	dropNone         dropReason = -1       // not dropped
	dropTruncated    dropReason = iota - 1 // a frame or inner packet shorter than it says
	dropVersion                            // unknown frame version
	dropType                               // unknown frame type or flags
	dropEncrypted                          // encrypted frame while encryption is off
	dropMalformed                          // an inner packet that is not a valid IPv4 packet
	dropUnknownPeer                        // from an underlay address that is no known peer
	dropNoRoute                            // destination in no range of the ring
	dropNoPeer                             // the owner is not a peer this node knows the address of
	dropIncompatible                       // the owner advertises no mode this node can use
	dropLocal                              // from the TUN device for a range this node owns
	dropForwardLoop                        // already forwarded once, and still not for this node
	dropTTL                                // TTL expired on the extra forwarding hop
	dropNotIPv4                            // not IPv4 (e.g. IPv6 neighbour discovery from the TUN device)
	dropTooBig                             // too big for the path, with DF: an ICMP went back instead
	dropSendError                          // the underlay socket refused it
	dropTUNError                           // the TUN device refused it
	dropAuth                               // an encrypted frame that failed authentication
	dropReplay                             // an authentic frame seen before, or too old
	dropPlaintext                          // a plaintext frame (or IPIP packet) from a peer that must encrypt
	dropNoKey                              // encryption is on, but the peer publishes no usable public key
	dropSpoofed                            // a decapsulated packet whose inner source is not the sending peer's
	dropKeyBudget                          // a frame of a new key id beyond the peer's budget of key derivations
	numDropReasons
)

var dropReasonNames = [numDropReasons]string{
	"truncated", "version", "type", "encrypted", "malformed", "unknown-peer",
	"no-route", "no-peer", "incompatible", "local", "forward-loop", "ttl",
	"not-ipv4", "too-big", "send-error", "tun-error",
	"auth", "replay", "plaintext", "no-key", "spoofed-source", "key-budget",
}

// Packet directions for the traffic counters.
const (
	dirOut     = iota // from the TUN device to a peer
	dirIn             // from a peer to the TUN device
	dirForward        // from a peer forwarded once more to the owner
	numDirs
)

var dirNames = [numDirs]string{"out", "in", "forwarded"}

// The wire modes, as indexes of the counters.
const (
	idxUDP = iota
	idxIPIP
	numWireModes
)

var wireModes = [numWireModes]Mode{ModeUDP, ModeIPIP}

func modeIndex(m Mode) int {
	if m == ModeIPIP {
		return idxIPIP
	}
	return idxUDP
}

// metrics are the tunnel's Prometheus collectors. The hot path counts in a
// per-goroutine tally and adds it here once per batch.
type metrics struct {
	packets  *prometheus.CounterVec // direction, mode
	bytes    *prometheus.CounterVec // direction, mode
	dropped  *prometheus.CounterVec // reason
	icmp     prometheus.Counter
	peerMode *prometheus.GaugeVec // peer, mode
	// pathUp and pathChanges: the vxlan path probes (probe.go).
	pathUp      *prometheus.GaugeVec   // peer
	pathChanges *prometheus.CounterVec // to: down, up
	csumProbes  *prometheus.CounterVec // outcome: good, bad, lost (csumprobe.go)
	pkt, byt    [numDirs][numWireModes]prometheus.Counter
	drop        [numDropReasons]prometheus.Counter
	collected   []prometheus.Collector
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		packets: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "weft_tunnel_packets_total",
			Help: "Packets carried by the tunnel, by direction (out: to a peer, in: from a peer, forwarded: once more to the owner) and mode.",
		}, []string{"direction", "mode"}),
		bytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "weft_tunnel_bytes_total",
			Help: "Bytes of inner packets carried by the tunnel, by direction and mode.",
		}, []string{"direction", "mode"}),
		dropped: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "weft_tunnel_dropped_packets_total",
			Help: "Packets the tunnel dropped, by reason (auth: failed authentication; replay: duplicate or too old; plaintext: unencrypted from a peer outside the trusted subnets; no-key: the peer has no public key; unknown-peer: from an underlay address that is no peer; spoofed-source: the inner source is outside the ranges of the peer that sent it; key-budget: a new key id beyond the peer's budget).",
		}, []string{"reason"}),
		icmp: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "weft_tunnel_icmp_frag_needed_total",
			Help: "ICMP fragmentation-needed messages sent back for packets too big for the path.",
		}),
		peerMode: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "weft_tunnel_peer_mode",
			Help: "1 for the encapsulation mode used to send to each peer (mode \"none\" when the peer has no mode in common).",
		}, []string{"peer", "mode"}),
		pathUp: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "weft_tunnel_vxlan_path_up",
			Help: "1 while the probes of the vxlan path to a peer are answered, 0 while it is down (auto then sends the peer udp).",
		}, []string{"peer"}),
		pathChanges: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "weft_tunnel_vxlan_path_changes_total",
			Help: "Changes of a peer's vxlan path, by what it became (down: the probes went unanswered; up: answered again after the hold).",
		}, []string{"to"}),
		csumProbes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "weft_tunnel_vxlan_checksum_probes_total",
			Help: "This node's vxlan checksum probes (a UDP datagram whose checksum the device completes), by outcome: good (the peer's router found it right), bad (found it wrong), lost (no answer, while the same datagram without a checksum was answered). bad and lost point to a checksum-offload fault; rounds with no answer at all are not counted.",
		}, []string{"outcome"}),
	}
	for d := range numDirs {
		for i, mode := range wireModes {
			m.pkt[d][i] = m.packets.WithLabelValues(dirNames[d], string(mode))
			m.byt[d][i] = m.bytes.WithLabelValues(dirNames[d], string(mode))
		}
	}
	for r := range numDropReasons {
		m.drop[r] = m.dropped.WithLabelValues(dropReasonNames[r])
	}
	cs := []prometheus.Collector{m.packets, m.bytes, m.dropped, m.icmp, m.peerMode, m.pathUp, m.pathChanges, m.csumProbes}
	if err := promreg.Register(reg, cs...); err != nil {
		return nil, err
	}
	if reg != nil {
		m.collected = cs
	}
	return m, nil
}

func (m *metrics) unregister(reg prometheus.Registerer) {
	for _, c := range m.collected {
		reg.Unregister(c)
	}
	m.collected = nil
}

// tally is one goroutine's counts since its last flush.
type tally struct {
	pkt, byt [numDirs][numWireModes]uint64
	drop     [numDropReasons]uint64
	icmp     uint64
}

func (t *tally) count(dir, mode, bytes int) {
	t.pkt[dir][mode]++
	t.byt[dir][mode] += uint64(bytes)
}

// flush adds the tally to the metrics and clears it.
func (m *metrics) flush(t *tally) {
	for d := range numDirs {
		for i := range numWireModes {
			if t.pkt[d][i] != 0 {
				m.pkt[d][i].Add(float64(t.pkt[d][i]))
				m.byt[d][i].Add(float64(t.byt[d][i]))
			}
		}
	}
	for r, n := range t.drop {
		if n != 0 {
			m.drop[r].Add(float64(n))
		}
	}
	if t.icmp != 0 {
		m.icmp.Add(float64(t.icmp))
	}
	*t = tally{}
}
