// Package router is the weft daemon: it wires the allocator, the bridge, the
// local API for the CNI plugin and the status server of one peer, and keeps
// them converged until it is stopped.
package router

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/weft-net/weft/ipalloc"
	"github.com/weft-net/weft/tunnel"
	"github.com/weft-net/weft/tunnel/crypt"
)

// Config is every option of `weft router`. Field tags name the flag.
type Config struct {
	Name         string // --name: peer name; empty = persisted or random
	Nickname     string // --nickname
	Host         string // --host: underlay address to advertise; empty = the default route's
	Port         int    // --port: gossip
	DataPort     int    // --data-port: encapsulated data
	Peers        string // --peers: comma list
	IPAllocRange string // --ipalloc-range
	IPAllocInit  string // --ipalloc-init
	HTTPAddr     string // --http-addr: read-only status
	Socket       string // --socket: local API
	StateDir     string // --state-dir
	Bridge       string // --bridge
	MTU          int    // --mtu: 0 = derive
	Encap        string // --encap
	VXLANPort    int    // --vxlan-port: UDP port of the kernel VXLAN device (vxlan, auto)
	VXLANVNI     int    // --vxlan-vni: its VXLAN network identifier
	CNIBinDir    string // --cni-bin-dir
	CNIConfDir   string // --cni-conf-dir
	LogLevel     string // --log-level
	// GCGrace (--gc-grace): CNI GC keeps an allocation younger than this,
	// as the runtime's list of attachments may predate its ADD; 0: none.
	GCGrace time.Duration

	// Security. The password itself is never a flag (it would show in the
	// process list): it comes from --password-file or WEFT_PASSWORD.
	PasswordFile   string // --password-file
	Password       string `json:"-"` // WEFT_PASSWORD (cmd/weft reads it); never printed
	TrustedSubnets string // --trusted-subnets: comma list of CIDRs

	// RequirePassword refuses to start without a password, so that a
	// missing or misnamed Secret fails closed instead of starting an open
	// mesh (--require-password, WEFT_REQUIRE_PASSWORD).
	RequirePassword bool

	// Kubernetes.
	Kube            bool   // --kube: discover peers from the Node list, reclaim deleted nodes
	Kubeconfig      string // --kubeconfig: empty = in-cluster config
	KubeAddressType string // --kube-address-type: InternalIP, ExternalIP, ...
	NodeName        string // --node-name: this node's Node object (default $NODE_NAME, else the hostname)
	KubeNamespace   string // --kube-namespace: where weft's ConfigMap lives (default $POD_NAMESPACE, else kube-system)
	KubeDaemonSet   string // --kube-daemonset: weft's DaemonSet in KubeNamespace, watched for an uninstall; "" none
	// NetworkPolicy (--network-policy): "true", "false", or "" for the
	// default, which is on with --kube and off without.
	NetworkPolicy string
}

// Defaults returns the documented defaults.
func Defaults() Config {
	return Config{
		Port:         6783,
		DataPort:     6784,
		IPAllocRange: "10.32.0.0/12",
		IPAllocInit:  "consensus",
		HTTPAddr:     "127.0.0.1:6784",
		Socket:       "/run/weft/weft.sock",
		StateDir:     "/var/lib/weft",
		Bridge:       "weft",
		Encap:        "auto",
		VXLANPort:    tunnel.DefaultVXLANPort,
		VXLANVNI:     tunnel.DefaultVNI,
		CNIBinDir:    "/opt/cni/bin",
		CNIConfDir:   "/etc/cni/net.d",
		LogLevel:     "info",
		GCGrace:      ipalloc.DefaultGCGrace,

		KubeAddressType: "InternalIP",
		KubeNamespace:   "kube-system",
	}
}

// maxGCGrace bounds --gc-grace: a longer one keeps a released pod's
// address from GC for longer than a node's pods churn.
const maxGCGrace = time.Hour

// MinPasswordLen is the shortest password accepted: the keys derived from
// it protect every node's traffic.
const MinPasswordLen = 12

// InitMode is how the first claim of the ring is made.
type InitMode struct {
	Kind   string   // "consensus", "seed" or "observer"
	Quorum int      // consensus: number of peers expected; 0 = from --peers
	Seeds  []string // seed: the peers that share the ring
}

func (m InitMode) String() string {
	switch m.Kind {
	case "consensus":
		if m.Quorum > 0 {
			return fmt.Sprintf("consensus=%d", m.Quorum)
		}
		return "consensus"
	case "seed":
		return "seed=" + strings.Join(m.Seeds, ",")
	}
	return m.Kind
}

// ParseInit parses --ipalloc-init.
func ParseInit(s string) (InitMode, error) {
	kind, arg, hasArg := strings.Cut(strings.TrimSpace(s), "=")
	switch kind {
	case "consensus":
		if !hasArg {
			return InitMode{Kind: kind}, nil
		}
		n, err := strconv.Atoi(arg)
		if err != nil || n < 1 || n > 10000 {
			return InitMode{}, fmt.Errorf("invalid --ipalloc-init %q: consensus=N needs N between 1 and 10000, the number of peers that start the cluster", s)
		}
		return InitMode{Kind: kind, Quorum: n}, nil
	case "seed":
		var seeds []string
		for _, p := range strings.Split(arg, ",") {
			if p = strings.TrimSpace(p); p != "" {
				seeds = append(seeds, p)
			}
		}
		if len(seeds) == 0 {
			return InitMode{}, fmt.Errorf("invalid --ipalloc-init %q: seed= needs the comma-separated names of the peers that share the ring", s)
		}
		return InitMode{Kind: kind, Seeds: seeds}, nil
	case "observer":
		if hasArg {
			return InitMode{}, fmt.Errorf("invalid --ipalloc-init %q: observer takes no value", s)
		}
		return InitMode{Kind: kind}, nil
	}
	return InitMode{}, fmt.Errorf("invalid --ipalloc-init %q: use consensus[=N], seed=name1,name2,... or observer", s)
}

// Validated is a Config with its values parsed, each under a name of its
// own (EncapMode for Encap, HostAddr for Host, ...), so that a Config
// field is never shadowed: cfg.Host is always the flag's text.
type Validated struct {
	Config
	Universe  netip.Prefix
	Init      InitMode
	EncapMode tunnel.Mode // --encap
	HostAddr  netip.Addr  // --host; zero: detect from the default route
	PeerList  []string    // --peers
	Level     slog.Level
	// Secret is the shared password (from --password-file or
	// WEFT_PASSWORD); nil means no encryption.
	Secret          []byte
	TrustedPrefixes []netip.Prefix // --trusted-subnets
	// Policy: enforce NetworkPolicies (--network-policy, on by default
	// with --kube).
	Policy bool
}

// Validate checks every option and returns them parsed; the error names the
// option and says what to give instead.
func (c Config) Validate() (*Validated, error) {
	v := &Validated{Config: c}
	var errs []error
	add := func(err error) {
		if err != nil {
			errs = append(errs, err)
		}
	}
	var err error
	v.Universe, err = ipalloc.ParseUniverse(c.IPAllocRange)
	add(err)
	v.Init, err = ParseInit(c.IPAllocInit)
	add(err)
	v.EncapMode, err = tunnel.ParseMode(c.Encap)
	add(err)
	if err := v.Level.UnmarshalText([]byte(c.LogLevel)); err != nil {
		add(fmt.Errorf("invalid --log-level %q: use debug, info, warn or error", c.LogLevel))
	}
	if c.Host != "" {
		v.HostAddr, err = netip.ParseAddr(c.Host)
		if err != nil || !v.HostAddr.Is4() {
			add(fmt.Errorf("invalid --host %q: give this node's IPv4 underlay address", c.Host))
		}
	}
	if c.GCGrace < 0 || c.GCGrace > maxGCGrace {
		add(fmt.Errorf("invalid --gc-grace %s: give a duration from 0s (GC collects at once) to %s; the default %s outlasts any runtime's GC", c.GCGrace, maxGCGrace, ipalloc.DefaultGCGrace))
	}
	add(checkPort("--port", c.Port))
	add(checkPort("--data-port", c.DataPort))
	add(checkPort("--vxlan-port", c.VXLANPort))
	if c.VXLANVNI < 1 || c.VXLANVNI > tunnel.MaxVNI {
		add(fmt.Errorf("invalid --vxlan-vni %d: give 1..%d, the same on every node (default %d)", c.VXLANVNI, tunnel.MaxVNI, tunnel.DefaultVNI))
	}
	if (v.EncapMode == tunnel.ModeVXLAN || v.EncapMode == tunnel.ModeAuto) && (c.VXLANPort == c.DataPort || c.VXLANPort == c.Port) {
		add(fmt.Errorf("invalid --vxlan-port %d: it is also the gossip or data port; give another (default %d)", c.VXLANPort, tunnel.DefaultVXLANPort))
	}
	if c.MTU != 0 {
		_, err := tunnel.PodMTU(0, c.MTU, tunnel.ModeAuto)
		add(err)
	}
	if c.Name != "" {
		add(ValidatePeerName(c.Name))
	}
	if len(c.Nickname) > 63 {
		add(fmt.Errorf("invalid --nickname %q: at most 63 characters", c.Nickname))
	}
	for _, p := range strings.Split(c.Peers, ",") {
		if p = strings.TrimSpace(p); p != "" {
			v.PeerList = append(v.PeerList, p)
		}
	}
	if _, _, err := net.SplitHostPort(c.HTTPAddr); err != nil {
		add(fmt.Errorf("invalid --http-addr %q: give host:port, e.g. 127.0.0.1:6784", c.HTTPAddr))
	}
	for flag, p := range map[string]string{"--socket": c.Socket, "--state-dir": c.StateDir, "--cni-bin-dir": c.CNIBinDir, "--cni-conf-dir": c.CNIConfDir} {
		if p == "" || !filepath.IsAbs(p) {
			add(fmt.Errorf("invalid %s %q: give an absolute path", flag, p))
		}
	}
	if len(c.Socket) > 107 {
		add(fmt.Errorf("invalid --socket %q: a unix socket path is limited to 107 bytes", c.Socket))
	}
	if err := validateIfName(c.Bridge); err != nil {
		add(fmt.Errorf("invalid --bridge %q: %w", c.Bridge, err))
	}
	v.Secret, err = c.password()
	add(err)
	for _, s := range strings.Split(c.TrustedSubnets, ",") {
		if s = strings.TrimSpace(s); s == "" {
			continue
		}
		p, err := netip.ParsePrefix(s)
		if err != nil || !p.Addr().Is4() {
			add(fmt.Errorf("invalid --trusted-subnets entry %q: give IPv4 CIDRs, e.g. 10.0.0.0/16,192.168.1.0/24", s))
			continue
		}
		v.TrustedPrefixes = append(v.TrustedPrefixes, p.Masked())
	}
	if v.EncapMode == tunnel.ModeVXLAN && v.Secret != nil && len(v.TrustedPrefixes) == 0 {
		add(errors.New("--encap vxlan with a password: vxlan cannot be encrypted, so it is used only with peers in --trusted-subnets; give the underlay subnets whose traffic may go unencrypted in --trusted-subnets, or use --encap udp (sealed) or auto"))
	}
	switch c.NetworkPolicy {
	case "":
		v.Policy = c.Kube
	default:
		on, err := strconv.ParseBool(c.NetworkPolicy)
		switch {
		case err != nil:
			add(fmt.Errorf("invalid --network-policy %q: give true or false (default: true with --kube)", c.NetworkPolicy))
		case on && !c.Kube:
			add(errors.New("--network-policy needs --kube: the policies, pods and namespaces come from the Kubernetes API server; add --kube, or leave --network-policy out"))
		}
		v.Policy = on && c.Kube
	}
	if c.Kube {
		switch c.KubeAddressType {
		case "InternalIP", "ExternalIP", "Hostname", "InternalDNS", "ExternalDNS":
		default:
			add(fmt.Errorf("invalid --kube-address-type %q: use InternalIP (the default), ExternalIP, Hostname, InternalDNS or ExternalDNS", c.KubeAddressType))
		}
		if c.Kubeconfig != "" && !filepath.IsAbs(c.Kubeconfig) {
			add(fmt.Errorf("invalid --kubeconfig %q: give an absolute path (or none, in a cluster)", c.Kubeconfig))
		}
		if c.NodeName == "" {
			add(errors.New("--kube needs this node's name: set --node-name or NODE_NAME (the DaemonSet sets it from spec.nodeName)"))
		}
		if c.KubeNamespace == "" {
			add(errors.New("--kube needs --kube-namespace (or POD_NAMESPACE): where weft keeps its ConfigMap"))
		}
	}
	if len(errs) > 0 {
		return nil, errors.Join(errs...)
	}
	return v, nil
}

// password reads the shared secret from --password-file or WEFT_PASSWORD,
// with one rule for both (passwordFrom). Giving both is an error, so that
// nobody wonders which won; with RequirePassword, giving neither is too.
func (c Config) password() ([]byte, error) {
	var raw []byte
	var from string
	switch {
	case c.PasswordFile != "" && c.Password != "":
		return nil, errors.New("both --password-file and WEFT_PASSWORD are set: give only one")
	case c.PasswordFile != "":
		data, err := os.ReadFile(c.PasswordFile)
		if err != nil {
			return nil, fmt.Errorf("reading --password-file: %w", err)
		}
		raw, from = data, "--password-file "+c.PasswordFile
	case c.Password != "":
		raw, from = []byte(c.Password), "WEFT_PASSWORD"
	case c.RequirePassword:
		return nil, errors.New("--require-password is set but no password is given: set --password-file or WEFT_PASSWORD, the same on every node " +
			"(in Kubernetes: create the Secret kube-system/weft-passwd with the key \"password\"; a missing or misnamed Secret or key leaves WEFT_PASSWORD unset)")
	default:
		return nil, nil
	}
	pw, err := passwordFrom(raw)
	if err != nil {
		return nil, fmt.Errorf("the password from %s: %w", from, err)
	}
	return pw, nil
}

// passwordFrom is the one rule for a password, from a file or from
// WEFT_PASSWORD alike: one line ending at its end (\n or \r\n, as an
// editor, `echo` or a Secret made from a file leave it) is cut
// (crypt.TrimPassword); nothing else is, so spaces are part of the
// password. What is left must be one line of printable characters: a line
// break or another control character is an error rather than a password
// that quietly differs from the other nodes'. It has at least
// MinPasswordLen bytes.
func passwordFrom(raw []byte) ([]byte, error) {
	pw := crypt.TrimPassword(raw)
	if len(pw) == 0 {
		return nil, errors.New("it is empty: put the cluster's password in it (the same on every node)")
	}
	for _, b := range pw {
		if b < ' ' || b == 0x7f {
			if b == '\n' || b == '\r' {
				return nil, errors.New("it has more than one line (or ends with two line breaks): a password is one line, and only the line break at its end is cut")
			}
			return nil, fmt.Errorf("it contains the control character %#02x: use printable characters (e.g. `openssl rand -base64 24`)", b)
		}
	}
	if len(pw) < MinPasswordLen {
		return nil, fmt.Errorf("it is %d bytes long; give at least %d (e.g. `openssl rand -base64 24`)", len(pw), MinPasswordLen)
	}
	return pw, nil
}

func checkPort(flag string, p int) error {
	if p < 1 || p > 65535 {
		return fmt.Errorf("invalid %s %d: give a port between 1 and 65535", flag, p)
	}
	return nil
}

// ValidatePeerName checks a --name: printable, no spaces, at most 64 bytes.
func ValidatePeerName(n string) error {
	if n == "" || len(n) > 64 {
		return fmt.Errorf("invalid --name %q: give 1 to 64 characters", n)
	}
	for _, r := range n {
		if r <= ' ' || r > '~' || r == '(' || r == ')' || r == ',' {
			return fmt.Errorf("invalid --name %q: only printable ASCII without spaces, commas or parentheses", n)
		}
	}
	return nil
}

func validateIfName(n string) error {
	if n == "" || len(n) > 15 {
		return errors.New("an interface name has 1 to 15 characters")
	}
	if strings.ContainsAny(n, "/: \t\n") || n == "." || n == ".." {
		return errors.New("an interface name cannot contain '/', ':' or white space")
	}
	return nil
}

// Options is the map that the start-up line prints: every option in effect.
// The password never appears: only whether there is one.
func (c Config) Options() map[string]string {
	pw := ""
	if c.Password != "" || c.PasswordFile != "" {
		pw = "<redacted>"
	}
	np := c.NetworkPolicy
	if np == "" {
		np = strconv.FormatBool(c.Kube) + " (the default with" + map[bool]string{true: "", false: "out"}[c.Kube] + " --kube)"
	}
	return map[string]string{
		"password": pw, "password-file": c.PasswordFile, "require-password": strconv.FormatBool(c.RequirePassword), "trusted-subnets": c.TrustedSubnets,
		"kube": strconv.FormatBool(c.Kube), "kubeconfig": c.Kubeconfig, "kube-address-type": c.KubeAddressType,
		"node-name": c.NodeName, "kube-namespace": c.KubeNamespace, "kube-daemonset": c.KubeDaemonSet,
		"network-policy": np,
		"name":           c.Name, "nickname": c.Nickname, "host": c.Host,
		"port": strconv.Itoa(c.Port), "data-port": strconv.Itoa(c.DataPort),
		"peers": c.Peers, "ipalloc-range": c.IPAllocRange, "ipalloc-init": c.IPAllocInit,
		"http-addr": c.HTTPAddr, "socket": c.Socket, "state-dir": c.StateDir,
		"bridge": c.Bridge, "mtu": strconv.Itoa(c.MTU), "encap": c.Encap,
		"vxlan-port": strconv.Itoa(c.VXLANPort), "vxlan-vni": strconv.Itoa(c.VXLANVNI),
		"cni-bin-dir": c.CNIBinDir, "cni-conf-dir": c.CNIConfDir, "log-level": c.LogLevel,
	}
}
