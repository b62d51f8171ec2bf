package nscluster

// Faults for chaos tests: a runtime that loses a pod without DEL, underlay
// links cut, traffic dropped one way or both inside a node, and a node's
// kernel state wiped as on a replaced machine. Each acts only inside the
// namespaces of the run; nothing here touches the root namespace's network.

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"strings"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// chaosTable is the nftables table DropFrom keeps in a node's namespace.
// Its input chain runs before weft's own rules (priority -200).
const chaosTable = "weftchaos"

// LosePod deletes p's namespace without CNI DEL and forgets it, as a
// runtime that crashed and lost its record of the pod would: the router
// still holds the address until GC. The veth goes with the namespace.
func (n *Node) LosePod(ctx context.Context, p *Pod) error {
	err := deleteNetns(ctx, p.NS, n.Cluster.Run.log.Warn)
	n.mu.Lock()
	delete(n.pods, p.Name)
	n.mu.Unlock()
	if err != nil {
		return fmt.Errorf("nscluster: losing pod %s: %w", p, err)
	}
	return nil
}

// SetUnderlayLink sets the underlay end of n's link (u-<node> on the
// underlay bridge) up or down: down cuts n off from every other node and
// from anything in the underlay namespace, both ways.
func (c *Cluster) SetUnderlayLink(n *Node, up bool) error {
	return c.Underlay.WithHandle(func(h *netlink.Handle) error {
		l, err := h.LinkByName("u-" + n.Name)
		if err != nil {
			return fmt.Errorf("nscluster: underlay link of %s: %w", n.Name, err)
		}
		if up {
			err = h.LinkSetUp(l)
		} else {
			err = h.LinkSetDown(l)
		}
		if err != nil {
			return fmt.Errorf("nscluster: setting the underlay link of %s up=%v: %w", n.Name, up, err)
		}
		return nil
	})
}

// DropFrom makes n drop every packet that arrives from the given underlay
// addresses (an nftables input chain in n's namespace, table weftchaos),
// replacing what an earlier call set; none removes the table. Packets n
// sends still leave, so a drop on one side only is a one-way partition.
func (n *Node) DropFrom(ctx context.Context, from []netip.Addr) error {
	// The table may not exist; deleting it is how it is emptied.
	_, _ = n.NS.Exec(ctx, "nft", "delete", "table", "inet", chaosTable)
	if len(from) == 0 {
		return nil
	}
	addrs := make([]string, len(from))
	for i, a := range from {
		if !a.Is4() {
			return fmt.Errorf("nscluster: DropFrom on %s: %s is not an IPv4 address", n.Name, a)
		}
		addrs[i] = a.String()
	}
	cmds := [][]string{
		{"nft", "add", "table", "inet", chaosTable},
		{"nft", "add", "chain", "inet", chaosTable, "in", "{ type filter hook input priority -200 ; policy accept ; }"},
		{"nft", "add", "rule", "inet", chaosTable, "in", "ip", "saddr", "{ " + strings.Join(addrs, ", ") + " }", "drop"},
	}
	for _, c := range cmds {
		if _, err := n.NS.Exec(ctx, c...); err != nil {
			return fmt.Errorf("nscluster: DropFrom on %s: %w", n.Name, err)
		}
	}
	return nil
}

// WipeMachine removes what a router left in n's kernel, as on a machine
// that was replaced: every link but lo and eth0 (the bridge, tunnel
// devices, host ends of veths) and every nftables table but weftchaos. The
// router must not run. Pods of n must be gone (LosePod) first.
func (n *Node) WipeMachine(ctx context.Context) error {
	if r := n.Router(); r != nil && r.Proc().Running() {
		return fmt.Errorf("nscluster: WipeMachine on %s while its router runs (pid %d)", n.Name, r.Proc().Pid())
	}
	err := n.NS.WithHandle(func(h *netlink.Handle) error {
		links, err := h.LinkList()
		if err != nil {
			return err
		}
		for _, l := range links {
			if name := l.Attrs().Name; name == "lo" || name == nodeIfName {
				continue
			}
			// The host ends of veths whose pods were deleted go on their
			// own, maybe meanwhile.
			if err := h.LinkDel(l); err != nil && !errors.Is(err, unix.ENODEV) {
				return fmt.Errorf("deleting link %s: %w", l.Attrs().Name, err)
			}
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("nscluster: wiping node %s: %w", n.Name, err)
	}
	out, err := n.NS.Exec(ctx, "nft", "list", "tables")
	if err != nil {
		return fmt.Errorf("nscluster: wiping node %s: %w", n.Name, err)
	}
	for _, line := range strings.Split(string(out), "\n") {
		f := strings.Fields(line) // "table <family> <name>"
		if len(f) != 3 || f[0] != "table" || f[2] == chaosTable {
			continue
		}
		if _, err := n.NS.Exec(ctx, "nft", "delete", "table", f[1], f[2]); err != nil {
			return fmt.Errorf("nscluster: wiping node %s: %w", n.Name, err)
		}
	}
	return nil
}
