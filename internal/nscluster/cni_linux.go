package nscluster

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"time"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/cni/pkg/invoke"
	"github.com/containernetworking/cni/pkg/types"
	types100 "github.com/containernetworking/cni/pkg/types/100"
	"github.com/containernetworking/cni/pkg/version"
)

// RefPluginDir is where Debian's containernetworking-plugins package puts the
// reference plugins (bridge, host-local, portmap, loopback, ...).
const RefPluginDir = "/usr/lib/cni"

// PodIfName is the interface name every pod gets.
const PodIfName = "eth0"

// podName keeps pod names short and valid in container ids and paths.
var podName = regexp.MustCompile(`^[a-z0-9][a-z0-9-]{0,19}$`)

// NSExec is a libcni invoke.Exec that runs plugins inside a node's namespace,
// as a container runtime on that node would: the plugin makes the host end of
// the veth (and the bridge) in the namespace it runs in. Each plugin is forked
// from a thread that entered the namespace (NetNS.Do), with invoke.RawExec.
type NSExec struct {
	NS *Netns
	// Stderr receives what plugins print on stderr when they succeed (on
	// failure it is in the error); nil discards it.
	Stderr io.Writer
	version.PluginDecoder
}

var _ invoke.Exec = (*NSExec)(nil)

// ExecPlugin runs the plugin inside e.NS.
func (e *NSExec) ExecPlugin(ctx context.Context, pluginPath string, stdin []byte, environ []string) ([]byte, error) {
	raw := &invoke.RawExec{Stderr: e.Stderr}
	var out []byte
	var execErr error
	if err := e.NS.Do(func() error {
		out, execErr = raw.ExecPlugin(ctx, pluginPath, stdin, environ)
		return nil
	}); err != nil {
		return nil, fmt.Errorf("entering netns %s to run %s: %w", e.NS.Name, pluginPath, err)
	}
	return out, execErr
}

// FindInPath finds a plugin binary in paths.
func (e *NSExec) FindInPath(plugin string, paths []string) (string, error) {
	return invoke.FindInPath(plugin, paths)
}

// Pod is a pod namespace on a node and its network attachment.
type Pod struct {
	Name        string
	Node        *Node
	NS          *Netns // <prefix>-<node>-<pod>
	ContainerID string // <prefix>-<node>-<pod>
	IfName      string // PodIfName

	// Filled by a successful ADD.
	Result  *types100.Result
	Prefix  netip.Prefix // the pod's address with its prefix length
	IP      netip.Addr   // Prefix.Addr()
	Gateway netip.Addr   // from the result; invalid when the plugin gave none
}

func (p *Pod) String() string { return p.Node.Name + "/" + p.Name }

// CNI is the node's runtime: libcni with NSExec and a cache directory of
// the node's own.
func (n *Node) CNI() *libcni.CNIConfig {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.cni == nil {
		exec := &NSExec{NS: n.NS, Stderr: appendWriter(n.CNILog)}
		n.cni = libcni.NewCNIConfigWithCacheDir(n.CNIPath, n.CNICacheDir, exec)
	}
	return n.cni
}

// ConfList loads the network configuration the way containerd does: the
// first .conflist file in CNIConfDir in lexical order. It is read on every
// call, so that a conflist the router rewrites is seen at once.
func (n *Node) ConfList() (*libcni.NetworkConfigList, error) {
	files, err := libcni.ConfFiles(n.CNIConfDir, []string{".conflist"})
	if err != nil {
		return nil, fmt.Errorf("e2e: reading CNI config dir of node %s: %w", n.Name, err)
	}
	if len(files) == 0 {
		return nil, fmt.Errorf("e2e: no .conflist in %s of node %s: start the router and WaitReady (it writes %s once ready), or WriteConfList",
			n.CNIConfDir, n.Name, ConfListFile)
	}
	// ConfFiles lists in directory order, which is lexical.
	list, err := libcni.ConfListFromFile(files[0])
	if err != nil {
		return nil, fmt.Errorf("e2e: node %s: %w", n.Name, err)
	}
	return list, nil
}

// WriteConfList writes a conflist into the node's CNIConfDir as file.
func (n *Node) WriteConfList(file string, data []byte) error {
	if _, err := libcni.ConfListFromBytes(data); err != nil {
		return fmt.Errorf("e2e: conflist %s for node %s: %w", file, n.Name, err)
	}
	if filepath.Base(file) != file || filepath.Ext(file) != ".conflist" {
		return fmt.Errorf("e2e: conflist file name %q must be a plain name ending in .conflist", file)
	}
	return os.WriteFile(filepath.Join(n.CNIConfDir, file), data, 0o644)
}

// UseRefConfList writes RefConfList(subnet) as the node's 10-ref.conflist,
// keeping host-local's state in the node's directory. Add RefPluginDir to
// ClusterOpts.CNIPath so that the plugins are found.
func (n *Node) UseRefConfList(subnet netip.Prefix, portmap bool) error {
	return n.WriteConfList("10-ref.conflist", RefConfList(subnet, filepath.Join(n.Dir, "ipam"), portmap))
}

// RefConfList is a conflist of the reference plugins: bridge "cni-ref" with
// the gateway address, host-local IPAM over subnet with its state in
// ipamDir, and a default route. It needs no iptables.
//
// With portmap, the chain ends in portmap as weft's does (nftables backend),
// so that whole chains can be compared.
func RefConfList(subnet netip.Prefix, ipamDir string, portmap bool) []byte {
	plugins := []any{map[string]any{
		"type":        "bridge",
		"bridge":      "cni-ref",
		"isGateway":   true,
		"ipMasq":      false,
		"hairpinMode": true,
		"ipam": map[string]any{
			"type":    "host-local",
			"ranges":  [][]map[string]string{{{"subnet": subnet.Masked().String()}}},
			"routes":  []map[string]string{{"dst": "0.0.0.0/0"}},
			"dataDir": ipamDir,
		},
	}}
	if portmap {
		plugins = append(plugins, map[string]any{"type": "portmap", "capabilities": map[string]bool{"portMappings": true}, "snat": true, "backend": "nftables"})
	}
	conf := map[string]any{"cniVersion": "1.0.0", "name": "ref", "plugins": plugins}
	data, err := json.MarshalIndent(conf, "", "  ")
	if err != nil {
		panic(err) // maps of strings always marshal
	}
	return data
}

// NewPod makes the pod's namespace and returns the pod, not yet attached:
// Attach runs ADD. AddPod does both.
func (n *Node) NewPod(ctx context.Context, name string) (*Pod, error) {
	if !podName.MatchString(name) {
		return nil, fmt.Errorf("e2e: pod name %q must be 1-20 lower-case letters, digits or '-', starting with a letter or digit", name)
	}
	n.mu.Lock()
	_, dup := n.pods[name]
	n.mu.Unlock()
	if dup {
		return nil, fmt.Errorf("e2e: node %s has a pod %q already", n.Name, name)
	}
	pns, err := n.Cluster.Run.NewNetns(ctx, n.Name+"-"+name)
	if err != nil {
		return nil, err
	}
	p := &Pod{Name: name, Node: n, NS: pns, ContainerID: pns.Name, IfName: PodIfName}
	n.mu.Lock()
	n.pods[name] = p
	n.mu.Unlock()
	return p, nil
}

// RuntimeConf is what the runtime passes to the plugins for p, with the
// CNI_ARGS a kubelet would set.
func (n *Node) RuntimeConf(p *Pod) *libcni.RuntimeConf {
	return &libcni.RuntimeConf{
		ContainerID: p.ContainerID,
		NetNS:       p.NS.Path,
		IfName:      p.IfName,
		Args: [][2]string{
			{"IgnoreUnknown", "1"},
			{"K8S_POD_NAMESPACE", "default"},
			{"K8S_POD_NAME", p.Name},
			{"K8S_POD_INFRA_CONTAINER_ID", p.ContainerID},
		},
	}
}

// Attach runs CNI ADD for p with the node's conflist and fills in p's
// result and addresses.
func (n *Node) Attach(ctx context.Context, p *Pod) error {
	list, err := n.ConfList()
	if err != nil {
		return err
	}
	start := time.Now()
	res, err := n.CNI().AddNetworkList(ctx, list, n.RuntimeConf(p))
	n.cniLog("ADD", p, start, err)
	if err != nil {
		return fmt.Errorf("e2e: CNI ADD of pod %s (network %q): %w", p, list.Name, err)
	}
	r, err := types100.NewResultFromResult(res)
	if err != nil {
		return fmt.Errorf("e2e: CNI ADD of pod %s: result: %w", p, err)
	}
	if len(r.IPs) == 0 {
		return fmt.Errorf("e2e: CNI ADD of pod %s gave no address: %s", p, mustJSON(r))
	}
	ipc := r.IPs[0]
	addr, ok := netip.AddrFromSlice(ipc.Address.IP)
	if !ok {
		return fmt.Errorf("e2e: CNI ADD of pod %s gave a bad address: %s", p, mustJSON(r))
	}
	ones, _ := ipc.Address.Mask.Size()
	p.Result = r
	p.IP = addr.Unmap()
	p.Prefix = netip.PrefixFrom(p.IP, ones)
	if gw, ok := netip.AddrFromSlice(ipc.Gateway); ok {
		p.Gateway = gw.Unmap()
	}
	return nil
}

// AddPod makes a pod namespace <prefix>-<node>-<name> and attaches it with
// CNI ADD. When ADD fails it runs DEL, as containerd does, and removes the
// namespace.
func (n *Node) AddPod(ctx context.Context, name string) (*Pod, error) {
	p, err := n.NewPod(ctx, name)
	if err != nil {
		return nil, err
	}
	if err := n.Attach(ctx, p); err != nil {
		if derr := n.RemovePod(context.WithoutCancel(ctx), p); derr != nil {
			n.Cluster.Run.log.Warn("cleaning up after a failed ADD", "pod", p.String(), "err", derr)
		}
		return nil, err
	}
	n.Cluster.Run.log.Debug("pod added", "pod", p.String(), "ip", p.Prefix)
	return p, nil
}

// CheckPod runs CNI CHECK for p.
func (n *Node) CheckPod(ctx context.Context, p *Pod) error {
	list, err := n.ConfList()
	if err != nil {
		return err
	}
	start := time.Now()
	err = n.CNI().CheckNetworkList(ctx, list, n.RuntimeConf(p))
	n.cniLog("CHECK", p, start, err)
	if err != nil {
		return fmt.Errorf("e2e: CNI CHECK of pod %s: %w", p, err)
	}
	return nil
}

// DelPod runs CNI DEL for p; the pod's namespace stays. DEL may be repeated.
func (n *Node) DelPod(ctx context.Context, p *Pod) error {
	list, err := n.ConfList()
	if err != nil {
		return err
	}
	start := time.Now()
	err = n.CNI().DelNetworkList(ctx, list, n.RuntimeConf(p))
	n.cniLog("DEL", p, start, err)
	if err != nil {
		return fmt.Errorf("e2e: CNI DEL of pod %s: %w", p, err)
	}
	return nil
}

// RemovePod runs DEL for p, deletes its namespace and forgets it.
func (n *Node) RemovePod(ctx context.Context, p *Pod) error {
	delErr := n.DelPod(ctx, p)
	nsErr := deleteNetns(ctx, p.NS, n.Cluster.Run.log.Warn)
	n.mu.Lock()
	delete(n.pods, p.Name)
	n.mu.Unlock()
	return errors.Join(delErr, nsErr)
}

// Pods lists the node's pods by name.
func (n *Node) Pods() []*Pod {
	n.mu.Lock()
	defer n.mu.Unlock()
	pods := make([]*Pod, 0, len(n.pods))
	for _, p := range n.pods {
		pods = append(pods, p)
	}
	slices.SortFunc(pods, func(a, b *Pod) int { return strings.Compare(a.Name, b.Name) })
	return pods
}

// GC runs CNI GC with valid as the attachments that still exist; plugins
// release everything else. libcni skips it for conflists older than 1.1.0.
func (n *Node) GC(ctx context.Context, valid []*Pod) error {
	list, err := n.ConfList()
	if err != nil {
		return err
	}
	args := &libcni.GCArgs{}
	for _, p := range valid {
		args.ValidAttachments = append(args.ValidAttachments, types.GCAttachment{ContainerID: p.ContainerID, IfName: p.IfName})
	}
	start := time.Now()
	err = n.CNI().GCNetworkList(ctx, list, args)
	n.cniLog("GC", nil, start, err)
	if err != nil {
		return fmt.Errorf("e2e: CNI GC on node %s: %w", n.Name, err)
	}
	return nil
}

// CNIStatus runs CNI STATUS: nil when the plugins can attach pods. libcni
// skips it for conflists older than 1.1.0.
func (n *Node) CNIStatus(ctx context.Context) error {
	list, err := n.ConfList()
	if err != nil {
		return err
	}
	start := time.Now()
	err = n.CNI().GetStatusNetworkList(ctx, list)
	n.cniLog("STATUS", nil, start, err)
	if err != nil {
		return fmt.Errorf("e2e: CNI STATUS on node %s: %w", n.Name, err)
	}
	return nil
}

// cniLog appends one line per CNI operation to the node's CNI log.
func (n *Node) cniLog(op string, p *Pod, start time.Time, err error) {
	what := "-"
	if p != nil {
		what = p.Name + " " + p.ContainerID
	}
	res := "ok"
	if err != nil {
		res = "error: " + err.Error()
	}
	line := fmt.Sprintf("%s %s %s %s: %s\n", time.Now().Format(time.RFC3339Nano), op, what, time.Since(start).Round(time.Microsecond), res)
	_, _ = appendWriter(n.CNILog).Write([]byte(line))
}

// appendWriter appends every Write to a file, opening it each time, so that
// no descriptor stays open between calls.
type appendWriter string

func (a appendWriter) Write(b []byte) (int, error) {
	f, err := os.OpenFile(string(a), os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
	if err != nil {
		return 0, err
	}
	n, err := f.Write(b)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	return n, err
}

func mustJSON(v any) string {
	b, err := json.Marshal(v)
	if err != nil {
		return fmt.Sprintf("%+v", v)
	}
	return string(b)
}
