// Package bridge keeps the local Linux bridge of a weft peer converged: the
// bridge itself, its gateway address, the forwarding sysctls and weft's own
// nftables table (masquerade for traffic leaving the pod range).
//
// Every step is an idempotent "ensure" in the style of CNI's ensureBridge and
// flannel's ensureLink: an existing bridge is adopted and repaired in place,
// never deleted while it is compatible, so that a daemon restart does not
// disturb the pods whose veths are attached to it. Whether an existing link is
// compatible, and what to change if it is not, is decided by the pure function
// Compare in this file; bridge_linux.go only observes the kernel and applies
// the plan.
package bridge

import (
	"bytes"
	"crypto/sha256"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strings"
)

// TableName is the name of weft's own nftables table (family ip). weft never
// touches rules outside it.
const TableName = "weft"

// Limits of Config.
const (
	MaxNameLen = 15 // IFNAMSIZ - 1
	MinMTU     = 68 // the IPv4 minimum
	MaxMTU     = 65535
)

// Config is the state the bridge is converged on.
type Config struct {
	// Name is the bridge name, e.g. "weft".
	Name string
	// MTU is the bridge MTU.
	MTU int
	// Gateway is the bridge's address with the prefix length of the pod
	// network, e.g. 10.32.0.1/12: the default gateway of the pods.
	Gateway netip.Prefix
	// PodRange is the whole pod range, e.g. 10.32.0.0/12. Addresses inside it
	// on the bridge other than Gateway are stale and removed; traffic from it
	// to elsewhere is masqueraded.
	PodRange netip.Prefix
	// Guard protects the node's routers from its pods and the pods from
	// each other (guard.go); the zero Guard is off.
	Guard Guard
}

// Validate says what is wrong with cfg, in words an operator can act on.
func (cfg Config) Validate() error {
	if err := validateName(cfg.Name); err != nil {
		return err
	}
	if d := cfg.Guard.VXLANDevice; d != "" {
		if err := validateName(d); err != nil {
			return fmt.Errorf("the guard's VXLAN device: %w", err)
		}
	}
	if cfg.MTU < MinMTU || cfg.MTU > MaxMTU {
		return fmt.Errorf("bridge MTU %d is out of range: it must be between %d and %d", cfg.MTU, MinMTU, MaxMTU)
	}
	r := cfg.PodRange
	switch {
	case !r.IsValid():
		return errors.New("pod range is not set: give it as a CIDR, e.g. 10.32.0.0/12")
	case !r.Addr().Is4():
		return fmt.Errorf("pod range %s is not IPv4: weft supports IPv4 pod ranges only", r)
	case r.Bits() < 1 || r.Bits() > 30:
		return fmt.Errorf("pod range %s has prefix length /%d: it must be between /1 and /30", r, r.Bits())
	case r != r.Masked():
		return fmt.Errorf("pod range %s has host bits set: did you mean %s?", r, r.Masked())
	}
	gw := cfg.Gateway
	switch {
	case !gw.IsValid():
		return errors.New("gateway is not set: give the bridge address with the pod network's prefix length, e.g. 10.32.0.1/12")
	case !gw.Addr().Is4():
		return fmt.Errorf("gateway %s is not IPv4: weft supports IPv4 only", gw)
	case !r.Contains(gw.Addr()):
		return fmt.Errorf("gateway %s is outside the pod range %s", gw, r)
	case gw.Bits() < r.Bits():
		return fmt.Errorf("gateway %s has a shorter prefix than the pod range %s: use /%d", gw, r, r.Bits())
	case gw.Bits() <= 30 && gw.Addr() == gw.Masked().Addr():
		return fmt.Errorf("gateway %s is the network address of %s: pick a host address", gw, gw.Masked())
	case gw.Bits() <= 30 && gw.Addr() == lastAddr(gw):
		return fmt.Errorf("gateway %s is the broadcast address of %s: pick a host address", gw, gw.Masked())
	}
	return nil
}

// validateName checks a link name as Linux accepts it.
func validateName(name string) error {
	switch {
	case name == "":
		return errors.New("bridge name is empty")
	case len(name) > MaxNameLen:
		return fmt.Errorf("bridge name %q is %d characters long; Linux allows at most %d", name, len(name), MaxNameLen)
	case name == "." || name == "..":
		return fmt.Errorf("bridge name %q is not allowed", name)
	case strings.ContainsAny(name, "/: \t\n"):
		return fmt.Errorf("bridge name %q contains '/', ':' or white space", name)
	}
	return nil
}

// lastAddr is the highest address of p (its broadcast address). p is IPv4.
func lastAddr(p netip.Prefix) netip.Addr {
	a := p.Masked().Addr().As4()
	host := uint32(1)<<(32-p.Bits()) - 1
	v := uint32(a[0])<<24 | uint32(a[1])<<16 | uint32(a[2])<<8 | uint32(a[3])
	v |= host
	return netip.AddrFrom4([4]byte{byte(v >> 24), byte(v >> 16), byte(v >> 8), byte(v)})
}

// StableMAC is the MAC address weft gives a bridge it creates: a locally
// administered unicast address derived from the bridge name. A bridge whose
// MAC was set explicitly keeps it when ports join; otherwise Linux gives it the
// lowest MAC of its ports, and the pods' gateway MAC would change under them.
// Bridges on different nodes share the MAC, which is harmless: weft routes
// between nodes, so no two bridges are ever in one L2 segment.
func StableMAC(name string) net.HardwareAddr {
	sum := sha256.Sum256([]byte("weft bridge " + name))
	mac := net.HardwareAddr(sum[:6])
	mac[0] = mac[0]&^0x01 | 0x02 // unicast, locally administered
	return mac
}

// Link is what the kernel reports about the link that has the bridge's name:
// the input of Compare.
type Link struct {
	Kind  string           // netlink link type: "bridge", "veth", "macvlan", ...
	MTU   int              // its MTU
	Up    bool             // administratively up (IFF_UP)
	MAC   net.HardwareAddr // its hardware address
	Ports int              // how many links are attached to it
	Addrs []netip.Prefix   // its IPv4 addresses
}

// Plan is what to change to converge a link on a Config. The zero Plan means
// the link is compatible and nothing needs to change.
type Plan struct {
	// Create says that a new bridge must be created.
	Create bool
	// Delete says that the existing link must be deleted first, because it
	// cannot be adopted; Reason says why.
	Delete bool
	Reason string
	// MTU is the MTU to set; 0 leaves it.
	MTU int
	// MAC is the hardware address to set; nil leaves it. For a bridge that
	// already has ports this is its current MAC: setting it explicitly pins it
	// without changing it.
	MAC net.HardwareAddr
	// Up says that the link must be set up.
	Up bool
	// RemoveAddrs are stale addresses inside the pod range to remove.
	RemoveAddrs []netip.Prefix
	// AddGateway says that the gateway address must be added.
	AddGateway bool
}

// IsZero reports whether the plan changes nothing.
func (p Plan) IsZero() bool {
	return !p.Create && !p.Delete && p.MTU == 0 && p.MAC == nil && !p.Up &&
		len(p.RemoveAddrs) == 0 && !p.AddGateway
}

// Compare decides whether the link that has the bridge's name (nil: there is
// none) is compatible with cfg, and what to change if it is not. A bridge is
// always adopted and repaired in place; any other kind of link is replaced.
// cfg must be valid.
func Compare(cfg Config, have *Link) Plan {
	if have == nil {
		return Plan{Create: true, Reason: "no link named " + cfg.Name}
	}
	if have.Kind != "bridge" {
		return Plan{Create: true, Delete: true,
			Reason: fmt.Sprintf("link %q is a %s, not a bridge", cfg.Name, kindName(have.Kind))}
	}
	var p Plan
	if have.MTU != cfg.MTU {
		p.MTU = cfg.MTU
	}
	if stable := StableMAC(cfg.Name); !bytes.Equal(have.MAC, stable) {
		if have.Ports == 0 {
			p.MAC = stable // nothing is attached that could notice
		} else {
			p.MAC = have.MAC // pods know this MAC: keep it, but pin it
		}
	}
	if !have.Up {
		p.Up = true
	}
	p.AddGateway = true
	for _, a := range have.Addrs {
		switch {
		case a == cfg.Gateway:
			p.AddGateway = false
		case cfg.PodRange.Contains(a.Addr()):
			p.RemoveAddrs = append(p.RemoveAddrs, a)
		}
	}
	return p
}

// Changes describes the plan's steps for logs and Info.Changes, one line each.
func (p Plan) Changes(cfg Config, have *Link) []string {
	var out []string
	if p.Delete {
		out = append(out, "delete "+p.Reason)
	}
	if p.Create {
		out = append(out, fmt.Sprintf("create bridge %s (MTU %d, MAC %s)", cfg.Name, cfg.MTU, StableMAC(cfg.Name)))
	}
	if p.MTU != 0 && have != nil {
		out = append(out, fmt.Sprintf("set MTU %d (was %d)", p.MTU, have.MTU))
	}
	if p.MAC != nil && have != nil {
		if bytes.Equal(p.MAC, have.MAC) {
			out = append(out, fmt.Sprintf("pin MAC %s (ports are attached, keep it)", p.MAC))
		} else {
			out = append(out, fmt.Sprintf("set MAC %s (was %s)", p.MAC, have.MAC))
		}
	}
	for _, a := range p.RemoveAddrs {
		out = append(out, fmt.Sprintf("remove stale pod-range address %s", a))
	}
	if p.AddGateway {
		out = append(out, fmt.Sprintf("add gateway address %s", cfg.Gateway))
	}
	if p.Up {
		out = append(out, "set up")
	}
	return out
}

func kindName(kind string) string {
	if kind == "" {
		return "link of unknown type"
	}
	return kind
}

// Info reports the bridge after Ensure.
type Info struct {
	Index int              // ifindex of the bridge
	MAC   net.HardwareAddr // its hardware address
	MTU   int              // its MTU
	// Changes lists what Ensure changed, one line each, in order; empty when
	// everything already was as configured.
	Changes []string
}

// sysctlSetting is one sysctl and the value weft needs.
type sysctlSetting struct {
	Key  string // slash form, so that link names with dots survive
	Want string
}

// sysctls are the sysctls the bridge needs. Pods hold addresses with the
// prefix length of the whole pod range, so they ARP for remote pods as if
// they were on the bridge: proxy ARP makes the node answer for every
// address it routes elsewhere (the remote ranges, routed into the tunnel),
// at once rather than after the default random delay of up to 0.8 s. Local
// pods answer for themselves: the kernel never proxies for an address that
// is routed back out of the interface the request came in on.
func sysctls(bridge string) []sysctlSetting {
	return []sysctlSetting{
		{Key: "net/ipv4/ip_forward", Want: "1"},
		{Key: "net/ipv4/conf/" + bridge + "/forwarding", Want: "1"},
		{Key: "net/ipv4/conf/" + bridge + "/proxy_arp", Want: "1"},
		{Key: "net/ipv4/neigh/" + bridge + "/proxy_delay", Want: "0"},
	}
}
