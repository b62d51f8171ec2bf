package nscluster

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"sync"

	"github.com/containernetworking/cni/libcni"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
)

// The underlay that joins the nodes of a cluster.
var (
	UnderlaySubnet  = netip.MustParsePrefix("10.250.0.0/24")
	UnderlayGateway = netip.MustParseAddr("10.250.0.254") // on the underlay bridge
)

const (
	underlayNS     = "ul"   // <prefix>-ul
	underlayBridge = "ulbr" // the bridge inside it
	nodeIfName     = "eth0" // a node's underlay interface
	maxNodes       = 253    // 10.250.0.1 .. 10.250.0.253
	// StatusAddr is where every node's router serves status, on the loopback
	// of the node's own namespace.
	StatusAddr = "127.0.0.1:6784"
)

// nodeName keeps names short: they go into link names ("u-<node>", at most
// 15 characters) and namespace names.
var nodeName = regexp.MustCompile(`^[a-z][a-z0-9]{0,11}$`)

// ClusterOpts shape a cluster.
type ClusterOpts struct {
	// Nodes is how many nodes to make at once, named n0, n1, ...; AddNode
	// adds more later.
	Nodes int
	// CNIPath lists directories searched for CNI plugins after each node's
	// own CNIBinDir, e.g. RefPluginDir for the reference plugins.
	CNIPath []string
	// MTU of the underlay links; 0 means 1500.
	MTU int
}

// Cluster is a set of nodes on one underlay bridge. A run has at most one.
type Cluster struct {
	Run      *Run
	Underlay *Netns // holds the underlay bridge, address UnderlayGateway
	// Nodes in the order they were made. AddNode appends; it is not safe to
	// call concurrently with itself or with readers of Nodes.
	Nodes []*Node

	opts ClusterOpts
}

// Node is one machine of the cluster: a namespace with eth0 on the underlay,
// and the directories a weft router and a container runtime use on it.
type Node struct {
	Name       string // e.g. "n0"; also the router's --nickname
	Index      int    // position in Cluster.Nodes
	NS         *Netns // <prefix>-<name>
	Cluster    *Cluster
	UnderlayIP netip.Addr // 10.250.0.(Index+1) on eth0
	// PeerName is passed as --name: a MAC-style name derived from the run
	// prefix and the node name, stable across restarts. Change it before
	// StartRouter to test something else.
	PeerName string

	Dir         string // the node's directory in the run's
	StateDir    string // --state-dir
	Socket      string // --socket, the local API
	CNIBinDir   string // --cni-bin-dir
	CNIConfDir  string // --cni-conf-dir
	CNICacheDir string // libcni's cache
	RouterLog   string // stdout and stderr of the router, appended across restarts
	CNILog      string // what the runtime did, and the plugins' stderr
	HTTPAddr    string // --http-addr, StatusAddr inside the node's namespace
	// CNIPath is where the runtime looks for plugins: CNIBinDir, then
	// ClusterOpts.CNIPath. Change it before the node's first CNI call.
	CNIPath []string

	mu     sync.Mutex // guards the fields below
	router *Router
	pods   map[string]*Pod
	cni    *libcni.CNIConfig
}

// NewCluster makes the underlay namespace with its bridge and opts.Nodes
// nodes on it.
func (r *Run) NewCluster(ctx context.Context, opts ClusterOpts) (*Cluster, error) {
	if opts.Nodes < 0 || opts.Nodes > maxNodes {
		return nil, fmt.Errorf("e2e: ClusterOpts.Nodes is %d; it must be between 0 and %d", opts.Nodes, maxNodes)
	}
	if opts.MTU == 0 {
		opts.MTU = 1500
	}
	if opts.MTU < 576 || opts.MTU > 65535 {
		return nil, fmt.Errorf("e2e: ClusterOpts.MTU is %d; it must be between 576 and 65535", opts.MTU)
	}
	r.mu.Lock()
	if r.cluster != nil {
		r.mu.Unlock()
		return nil, errors.New("e2e: this run already has a cluster; add nodes to it with AddNode")
	}
	c := &Cluster{Run: r, opts: opts}
	r.cluster = c
	r.mu.Unlock()

	ul, err := r.NewNetns(ctx, underlayNS)
	if err != nil {
		return nil, err
	}
	c.Underlay = ul
	err = ul.WithHandle(func(h *netlink.Handle) error {
		br := &netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: underlayBridge, MTU: opts.MTU}}
		if err := h.LinkAdd(br); err != nil {
			return fmt.Errorf("adding bridge %s: %w", underlayBridge, err)
		}
		gw := &netlink.Addr{IPNet: prefixIPNet(netip.PrefixFrom(UnderlayGateway, UnderlaySubnet.Bits()))}
		if err := h.AddrAdd(br, gw); err != nil {
			return fmt.Errorf("address %s on %s: %w", gw, underlayBridge, err)
		}
		return h.LinkSetUp(br)
	})
	if err != nil {
		return nil, fmt.Errorf("e2e: underlay in netns %s: %w", ul.Name, err)
	}
	for i := 0; i < opts.Nodes; i++ {
		if _, err := c.AddNode(ctx, ""); err != nil {
			return nil, err
		}
	}
	return c, nil
}

// AddNode makes a node named name ("" means n<index>) and connects it to the
// underlay: a veth pair from the node's eth0 to the underlay bridge, the
// node's underlay address, and a default route via the bridge.
func (c *Cluster) AddNode(ctx context.Context, name string) (*Node, error) {
	idx := len(c.Nodes)
	if name == "" {
		name = "n" + strconv.Itoa(idx)
	}
	if !nodeName.MatchString(name) {
		return nil, fmt.Errorf("e2e: node name %q must be 1-12 lower-case letters or digits, starting with a letter", name)
	}
	if name == underlayNS {
		return nil, fmt.Errorf("e2e: node name %q is taken by the underlay namespace", name)
	}
	for _, n := range c.Nodes {
		if n.Name == name {
			return nil, fmt.Errorf("e2e: the cluster has a node %q already", name)
		}
	}
	if idx >= maxNodes {
		return nil, fmt.Errorf("e2e: a cluster holds at most %d nodes (the underlay is %s)", maxNodes, UnderlaySubnet)
	}
	r := c.Run
	ip := netip.AddrFrom4([4]byte{10, 250, 0, byte(idx + 1)})
	n := &Node{
		Name: name, Index: idx, Cluster: c, UnderlayIP: ip,
		PeerName: peerName(r.prefix, name),
		Dir:      filepath.Join(r.dir, name),
		HTTPAddr: StatusAddr,
		pods:     map[string]*Pod{},
	}
	n.StateDir = filepath.Join(n.Dir, "state")
	n.Socket = filepath.Join(n.Dir, "weft.sock")
	n.CNIBinDir = filepath.Join(n.Dir, "cni-bin")
	n.CNIConfDir = filepath.Join(n.Dir, "cni-conf")
	n.CNICacheDir = filepath.Join(n.Dir, "cni-cache")
	n.RouterLog = filepath.Join(n.Dir, "router.log")
	n.CNILog = filepath.Join(n.Dir, "cni.log")
	n.CNIPath = append([]string{n.CNIBinDir}, c.opts.CNIPath...)
	if len(n.Socket) > 107 {
		return nil, fmt.Errorf("e2e: socket path %s is longer than a unix socket allows: set TMPDIR to a shorter directory", n.Socket)
	}
	for _, d := range []string{n.StateDir, n.CNIBinDir, n.CNIConfDir, n.CNICacheDir} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return nil, fmt.Errorf("e2e: node %s: %w", name, err)
		}
	}
	r.addLogFile(n.CNILog)

	var err error
	if n.NS, err = r.NewNetns(ctx, name); err != nil {
		return nil, err
	}
	if err := c.connect(n); err != nil {
		return nil, fmt.Errorf("e2e: connecting node %s to the underlay: %w", name, err)
	}
	c.Nodes = append(c.Nodes, n)
	r.log.Info("node ready", "node", name, "netns", n.NS.Name, "underlay", ip)
	return n, nil
}

// connect makes the veth pair u-<node> (on the underlay bridge) / eth0 (in
// the node), addresses eth0 and routes the node's default via the bridge.
func (c *Cluster) connect(n *Node) error {
	nodeNS, err := netns.GetFromPath(n.NS.Path)
	if err != nil {
		return err
	}
	defer nodeNS.Close()
	mtu := c.opts.MTU
	err = c.Underlay.WithHandle(func(h *netlink.Handle) error {
		br, err := h.LinkByName(underlayBridge)
		if err != nil {
			return err
		}
		veth := &netlink.Veth{
			LinkAttrs:     netlink.LinkAttrs{Name: "u-" + n.Name, MTU: mtu, MasterIndex: br.Attrs().Index},
			PeerName:      nodeIfName,
			PeerMTU:       uint32(mtu),
			PeerNamespace: netlink.NsFd(int(nodeNS)),
		}
		if err := h.LinkAdd(veth); err != nil {
			return fmt.Errorf("adding veth %s: %w", veth.Name, err)
		}
		return h.LinkSetUp(veth)
	})
	if err != nil {
		return err
	}
	return n.NS.WithHandle(func(h *netlink.Handle) error {
		eth, err := h.LinkByName(nodeIfName)
		if err != nil {
			return err
		}
		addr := &netlink.Addr{IPNet: prefixIPNet(netip.PrefixFrom(n.UnderlayIP, UnderlaySubnet.Bits()))}
		if err := h.AddrAdd(eth, addr); err != nil {
			return fmt.Errorf("address %s on %s: %w", addr, nodeIfName, err)
		}
		if err := h.LinkSetUp(eth); err != nil {
			return err
		}
		route := &netlink.Route{LinkIndex: eth.Attrs().Index, Gw: net.IP(UnderlayGateway.AsSlice())}
		if err := h.RouteAdd(route); err != nil {
			return fmt.Errorf("default route via %s: %w", UnderlayGateway, err)
		}
		return nil
	})
}

// Node returns the node with the given name, or nil.
func (c *Cluster) Node(name string) *Node {
	for _, n := range c.Nodes {
		if n.Name == name {
			return n
		}
	}
	return nil
}

// peerName derives a stable, locally administered MAC-style peer name.
func peerName(prefix, node string) string {
	h := sha256.Sum256([]byte(prefix + "/" + node))
	h[0] = h[0]&^0x01 | 0x02 // unicast, locally administered
	return net.HardwareAddr(h[:6]).String()
}

// prefixIPNet converts an address with prefix length to netlink's form.
func prefixIPNet(p netip.Prefix) *net.IPNet {
	bits := 32
	if p.Addr().Is6() {
		bits = 128
	}
	return &net.IPNet{IP: net.IP(p.Addr().AsSlice()), Mask: net.CIDRMask(p.Bits(), bits)}
}

// The bridges a cluster is made of, for tests that look at them: the
// underlay's (in the underlay namespace) and the pod bridge every router
// of a cluster makes (--bridge).
const (
	UnderlayBridge = underlayBridge
	RouterBridge   = routerBridge
)
