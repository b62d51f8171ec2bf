package tunnel

import (
	"fmt"
	"net/netip"
	"slices"
	"strings"
)

// Peer is another node as the mesh describes it: where its encapsulated
// data goes and which modes it accepts.
type Peer struct {
	Name     string
	Underlay netip.Addr // the node's underlay (host) address
	DataPort uint16     // its udp data port
	// Encaps is what the peer advertises, in its order of preference. A
	// peer that advertises nothing is taken to accept udp, the mode
	// every weft node has.
	Encaps []Mode
	// VTEP is the peer's end of the vxlan overlay, from its metadata;
	// nil if it publishes none (then vxlan is not used with it).
	VTEP *VTEP
	// PublicKey is the peer's data-plane public key, as it publishes it
	// in its mesh metadata (mesh.Meta.PublicKey); empty when the peer
	// runs without a password. With encryption on, a peer outside the
	// trusted subnets needs one.
	PublicKey []byte
}

// ParseEncaps turns the encapsulations a peer advertises in its mesh
// metadata into modes. Modes this version does not know (from a newer
// peer) are left out, not an error.
func ParseEncaps(advertised []string) []Mode {
	var out []Mode
	for _, s := range advertised {
		m := Mode(strings.ToLower(s))
		if _, ok := overheads[m]; ok && !slices.Contains(out, m) {
			out = append(out, m)
		}
	}
	return out
}

// ErrNoCommonMode is returned by ChooseMode when a peer shares no mode with
// this node.
var ErrNoCommonMode = fmt.Errorf("no encapsulation mode in common")

// ChooseMode picks the mode to send to a peer with. configured is this
// node's --encap; local is what this node can do, fastest first; remote is
// what the peer advertises. With auto, the first local mode the peer also
// has wins; with udp or ipip, the peer must have that mode.
func ChooseMode(configured Mode, local, remote []Mode) (Mode, error) {
	if len(remote) == 0 {
		remote = []Mode{ModeUDP}
	}
	candidates := local
	if configured != ModeAuto {
		candidates = []Mode{configured}
		if !slices.Contains(local, configured) {
			return "", fmt.Errorf("%w: this node cannot do --encap %s", ErrNoCommonMode, configured)
		}
	}
	for _, m := range candidates {
		if slices.Contains(remote, m) {
			return m, nil
		}
	}
	return "", fmt.Errorf("%w: the peer offers %s, this node %s (--encap %s)", ErrNoCommonMode, modeList(remote), modeList(candidates), configured)
}

func modeList(ms []Mode) string {
	if len(ms) == 0 {
		return "nothing"
	}
	s := make([]string, len(ms))
	for i, m := range ms {
		s[i] = string(m)
	}
	return strings.Join(s, ",")
}
