package mesh

import (
	"cmp"
	"fmt"
	"io"
	"net/netip"
	"slices"
	"text/tabwriter"
	"time"
)

// Connection is one line of the connection status: a peer this one gossips
// with, or a target it has not reached.
type Connection struct {
	Address string    `json:"address"`
	Outcome string    `json:"outcome"`         // "established" or "failed"
	State   string    `json:"state,omitempty"` // the peer's state, when it is a known peer
	Peer    PeerName  `json:"peer,omitempty"`
	Nick    string    `json:"nickname,omitempty"`
	Target  string    `json:"target,omitempty"` // the --peers (or remembered) entry it came from
	Error   string    `json:"error,omitempty"`
	Since   time.Time `json:"since,omitzero"`
}

// Report is the mesh part of the router's JSON /report.
type Report struct {
	Name        PeerName          `json:"name"`
	Nickname    string            `json:"nickname,omitempty"`
	Address     string            `json:"address"`
	PeerCount   int               `json:"peerCount"` // known peers that have not left, this one included
	Peers       []Peer            `json:"peers"`
	Connections []Connection      `json:"connections"`
	Established int               `json:"established"`
	Targets     []string          `json:"targets"`
	Dropped     map[string]uint64 `json:"droppedMessages,omitempty"` // by reason
}

// Report returns the mesh's status.
func (m *Mesh) Report() Report {
	peers := m.Peers()
	r := Report{
		Name: m.cfg.Name, Nickname: m.cfg.Nickname, Address: m.advertise.String(),
		Peers: peers, Targets: m.targetSpecs(), Dropped: m.droppedCounts(),
	}
	for _, p := range peers {
		if p.State != StateLeft {
			r.PeerCount++
		}
	}
	r.Connections = m.connections(peers)
	for _, c := range r.Connections {
		if c.Outcome == "established" {
			r.Established++
		}
	}
	return r
}

// connections lists every other peer that has not left, then every target
// that matches no such peer.
func (m *Mesh) connections(peers []Peer) []Connection {
	var out []Connection
	known := map[string]bool{}
	for _, p := range peers {
		if p.Self || p.State == StateLeft {
			continue
		}
		known[p.Addr.String()] = true
		c := Connection{Address: p.Addr.String(), Outcome: "failed", State: p.State.String(), Peer: p.Name, Nick: p.Nickname, Since: p.Since}
		if p.State == StateAlive || p.State == StateSuspect {
			c.Outcome = "established"
		}
		if p.MetaError != "" {
			c.Error = "invalid metadata: " + p.MetaError
		}
		out = append(out, c)
	}
	slices.SortFunc(out, func(a, b Connection) int { return cmp.Compare(a.Address, b.Address) })
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, t := range m.targets {
		if t.self {
			continue
		}
		matched := false
		for _, a := range t.addrs {
			matched = matched || known[a.String()]
		}
		if ip, err := netip.ParseAddr(t.host); err == nil && len(t.addrs) == 0 {
			// An address not yet resolved by the join loop (the peers
			// may have joined this one before it tried): it is literal.
			a := netip.AddrPortFrom(ip.Unmap(), uint16(t.port))
			matched = known[a.String()] || a == m.advertise
		}
		if matched {
			continue
		}
		c := Connection{Address: fmt.Sprintf("%s:%d", t.host, t.port), Outcome: "failed", Target: t.spec, Error: t.err, Since: t.lastTry}
		if c.Error == "" {
			c.Error = "not reached yet"
		}
		out = append(out, c)
	}
	return out
}

// WriteStatus writes the summary lines of the router's /status:
//
//	Peers: 3
//	Connections: 2 (2 established)
//	Targets: 2
func (m *Mesh) WriteStatus(w io.Writer) error {
	r := m.Report()
	_, err := fmt.Fprintf(w, "Peers: %d\nConnections: %d (%d established)\nTargets: %d\n",
		r.PeerCount, len(r.Connections), r.Established, len(r.Targets))
	return err
}

// WriteStatusPeers writes one line per known peer, this one first:
//
//	name(nickname)  address  state  last change  [note]
func (m *Mesh) WriteStatusPeers(w io.Writer) error {
	peers := m.Peers()
	slices.SortStableFunc(peers, func(a, b Peer) int {
		if a.Self != b.Self {
			if a.Self {
				return -1
			}
			return 1
		}
		return 0
	})
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	for _, p := range peers {
		note := ""
		switch {
		case p.Self:
			note = "(self)"
		case p.MetaError != "":
			note = "invalid metadata: " + p.MetaError
		case p.State == StateSuspect:
			note = "unreachable from " + joinNames(p.UnreachableFrom)
		}
		fmt.Fprintf(tw, "%s(%s)\t%s\t%s\t%s\t%s\n", p.Name, p.Nickname, p.Addr, p.State, p.Since.UTC().Format(time.RFC3339), note)
	}
	return tw.Flush()
}

// WriteStatusConnections writes one line per connection:
//
//	-> address  established|failed  state  name(nickname)  [error]
func (m *Mesh) WriteStatusConnections(w io.Writer) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	for _, c := range m.connections(m.Peers()) {
		who, state := "-", c.State
		if c.Peer != "" {
			who = fmt.Sprintf("%s(%s)", c.Peer, c.Nick)
		}
		if state == "" {
			state = "-"
		}
		fmt.Fprintf(tw, "-> %s\t%s\t%s\t%s\t%s\n", c.Address, c.Outcome, state, who, c.Error)
	}
	return tw.Flush()
}
