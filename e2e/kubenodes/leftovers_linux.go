package kubenodes

import (
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"strings"
)

// WeftLeftovers lists what weft made on node n that is still there, each
// as a line a person can read, as seen from inside the node's own network
// and mount namespaces: links named weft* (the bridge, the TUN and IPIP
// devices, pods' host veths), nftables tables named weft (any family),
// routes into the pod range PodRange or through a weft* link, the CNI
// config 10-weft.conflist, the state dir /var/lib/weft and the socket dir
// /run/weft and anything in them. None means the node is clean of weft (the CNI
// plugin binaries in /opt/cni/bin are not counted: they stay by design).
func (n *Node) WeftLeftovers(ctx context.Context) ([]string, error) {
	var left []string
	out, err := n.Exec(ctx, "ip", "-j", "link", "show")
	if err != nil {
		return nil, err
	}
	var links []struct {
		Name string `json:"ifname"`
		Info struct {
			Kind string `json:"info_kind"`
		} `json:"linkinfo"`
	}
	if err := json.Unmarshal(out, &links); err != nil {
		return nil, fmt.Errorf("kubenodes: ip -j link on %s: %w", n.Name, err)
	}
	for _, l := range links {
		if strings.HasPrefix(l.Name, "weft") {
			left = append(left, "link "+l.Name)
		}
	}
	if out, err = n.Exec(ctx, "nft", "list", "tables"); err != nil {
		return nil, err
	}
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		if f := strings.Fields(line); len(f) == 3 && f[0] == "table" && strings.HasPrefix(f[2], "weft") {
			left = append(left, "nftables "+line)
		}
	}
	if out, err = n.Exec(ctx, "ip", "-j", "-4", "route", "show", "table", "all"); err != nil {
		return nil, err
	}
	var routes []struct {
		Dst string `json:"dst"`
		Dev string `json:"dev"`
	}
	if err := json.Unmarshal(out, &routes); err != nil {
		return nil, fmt.Errorf("kubenodes: ip -j route on %s: %w", n.Name, err)
	}
	rng := netip.MustParsePrefix(PodRange)
	for _, r := range routes {
		in := false
		if p, err := netip.ParsePrefix(r.Dst); err == nil {
			in = rng.Overlaps(p) && p.Bits() >= rng.Bits()
		} else if a, err := netip.ParseAddr(r.Dst); err == nil {
			in = rng.Contains(a)
		}
		if in || strings.HasPrefix(r.Dev, "weft") {
			left = append(left, fmt.Sprintf("route %s dev %s", r.Dst, r.Dev))
		}
	}
	// Files, in the node's mount namespace: ls prints nothing for an empty
	// or missing directory (2>/dev/null), each entry otherwise.
	out, err = n.Exec(ctx, "sh", "-c", "ls -d /etc/cni/net.d/10-weft.conflist /var/lib/weft /run/weft 2>/dev/null; ls -A /var/lib/weft 2>/dev/null | sed 's|^|/var/lib/weft/|'; ls -A /run/weft 2>/dev/null | sed 's|^|/run/weft/|'; true")
	if err != nil {
		return nil, err
	}
	for _, f := range strings.Fields(string(out)) {
		left = append(left, "file "+f)
	}
	return left, nil
}
