package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"

	"k8s.io/klog/v2"

	"github.com/weft-net/weft/router"
)

// routerFlags binds every router option to fs.
func routerFlags(fs *flag.FlagSet, c *router.Config) {
	host, _ := os.Hostname()
	c.Nickname = host
	fs.StringVar(&c.Name, "name", c.Name, "peer name (default: the one persisted in --state-dir, made at first start)")
	fs.StringVar(&c.Nickname, "nickname", c.Nickname, "human-friendly peer name shown in status")
	fs.StringVar(&c.Host, "host", c.Host, "underlay IPv4 address to advertise (default: the address of the default route's interface)")
	fs.IntVar(&c.Port, "port", c.Port, "gossip port (TCP and UDP)")
	fs.IntVar(&c.DataPort, "data-port", c.DataPort, "encapsulated data port (UDP)")
	fs.StringVar(&c.Peers, "peers", c.Peers, "comma-separated peers to join, host[:port]")
	fs.StringVar(&c.IPAllocRange, "ipalloc-range", c.IPAllocRange, "pod address range (IPv4 CIDR) shared by all peers")
	fs.StringVar(&c.IPAllocInit, "ipalloc-init", c.IPAllocInit, "first claim of the range: consensus[=N], seed=name,..., or observer")
	fs.StringVar(&c.HTTPAddr, "http-addr", c.HTTPAddr, "read-only status server address")
	fs.StringVar(&c.Socket, "socket", c.Socket, "local API unix socket (for the CNI plugin and rmpeer)")
	fs.StringVar(&c.StateDir, "state-dir", c.StateDir, "directory for the persistent state")
	fs.StringVar(&c.Bridge, "bridge", c.Bridge, "name of the pod bridge")
	fs.IntVar(&c.MTU, "mtu", c.MTU, "pod MTU (0: the underlay MTU less the encapsulation overhead)")
	fs.StringVar(&c.Encap, "encap", c.Encap, "encapsulation: udp (userspace, sealed with a password), vxlan (kernel VXLAN, unencrypted), ipip or auto (per peer: vxlan where traffic may be unencrypted, else udp)")
	fs.IntVar(&c.VXLANPort, "vxlan-port", c.VXLANPort, "UDP port of the kernel VXLAN device for --encap vxlan and auto (the same on every node)")
	fs.IntVar(&c.VXLANVNI, "vxlan-vni", c.VXLANVNI, "VXLAN network identifier for --encap vxlan and auto, 1..16777215 (the same on every node)")
	fs.StringVar(&c.CNIBinDir, "cni-bin-dir", c.CNIBinDir, "where to install the CNI plugins")
	fs.StringVar(&c.CNIConfDir, "cni-conf-dir", c.CNIConfDir, "where to write the CNI network config")
	fs.StringVar(&c.LogLevel, "log-level", c.LogLevel, "debug, info, warn or error")
	fs.DurationVar(&c.GCGrace, "gc-grace", c.GCGrace, "CNI GC keeps an address allocated less than this long ago (its ADD may have raced the runtime's list of attachments); 0s: no grace")
	fs.StringVar(&c.PasswordFile, "password-file", c.PasswordFile, "file holding the cluster's shared password (or set WEFT_PASSWORD); without one, traffic between nodes is not encrypted")
	fs.BoolVar(&c.RequirePassword, "require-password", c.RequirePassword, "refuse to start without a password (--password-file or WEFT_PASSWORD), so that a missing Secret fails closed instead of an open mesh")
	fs.StringVar(&c.TrustedSubnets, "trusted-subnets", c.TrustedSubnets, "comma-separated CIDRs of underlay networks whose peers get unencrypted data traffic")
	fs.BoolVar(&c.Kube, "kube", c.Kube, "run as a Kubernetes DaemonSet: peers from the Node list, reclaim of deleted nodes, the first claim recorded in a ConfigMap")
	fs.StringVar(&c.Kubeconfig, "kubeconfig", c.Kubeconfig, "kubeconfig for --kube outside a cluster (default: the in-cluster config)")
	fs.StringVar(&c.KubeAddressType, "kube-address-type", c.KubeAddressType, "which Node address peers use: InternalIP, ExternalIP, ...")
	c.NodeName = os.Getenv("NODE_NAME")
	if c.NodeName == "" {
		c.NodeName = host
	}
	fs.StringVar(&c.NodeName, "node-name", c.NodeName, "this node's Node name for --kube (default: $NODE_NAME, else the hostname)")
	if ns := os.Getenv("POD_NAMESPACE"); ns != "" {
		c.KubeNamespace = ns
	}
	fs.StringVar(&c.KubeNamespace, "kube-namespace", c.KubeNamespace, "namespace of weft's ConfigMap for --kube (default: $POD_NAMESPACE, else kube-system)")
	fs.Var(optBool{&c.NetworkPolicy}, "network-policy", "enforce the cluster's NetworkPolicies for this node's pods (needs --kube; default: true with --kube); --network-policy=false leaves them to another controller")
	fs.StringVar(&c.KubeDaemonSet, "kube-daemonset", c.KubeDaemonSet, "weft's DaemonSet in --kube-namespace: when it is deleted (uninstall), a router that stops removes the CNI config, so that the node turns NotReady (default: none watched)")
}

// envDefaults sets every flag not given on the command line from
// WEFT_<FLAG> (upper case, '-' as '_'), if that is set.
func envDefaults(fs *flag.FlagSet) error {
	given := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { given[f.Name] = true })
	var errs []error
	fs.VisitAll(func(f *flag.Flag) {
		env := "WEFT_" + strings.ToUpper(strings.ReplaceAll(f.Name, "-", "_"))
		if v, ok := os.LookupEnv(env); ok && !given[f.Name] {
			if err := f.Value.Set(v); err != nil {
				errs = append(errs, fmt.Errorf("invalid %s=%q: %w", env, v, err))
			}
		}
	})
	return errors.Join(errs...)
}

func cmdRouter(args []string) error {
	cfg := router.Defaults()
	fs := flag.NewFlagSet("weft router", flag.ContinueOnError)
	routerFlags(fs, &cfg)
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q: every option is a flag", fs.Args())
	}
	if err := envDefaults(fs); err != nil {
		return err
	}
	// The password comes from the environment, never from a flag value
	// that every user of the machine could read in the process list.
	cfg.Password = os.Getenv("WEFT_PASSWORD")
	v, err := cfg.Validate()
	if err != nil {
		return err
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: v.Level}))
	// client-go logs through klog: into the same log, as one stream.
	klog.SetSlogLogger(clientGoLogger(log))
	log.Info(fmt.Sprintf("Command line options: %v", cfg.Options()))
	log.Info("weft router starting", "version", router.Version)
	router.SetRuntimeDefaults()

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	n, err := router.Build(ctx, v, log, nil)
	if err != nil {
		return err
	}
	return n.Run(ctx)
}

func cmdVersion([]string) error {
	fmt.Println("weft", router.Version)
	return nil
}

// optBool is a boolean flag that remembers whether it was given: unset,
// the router picks the default (--network-policy: on with --kube).
type optBool struct{ p *string }

func (o optBool) String() string {
	if o.p == nil {
		return ""
	}
	return *o.p
}

func (o optBool) Set(s string) error {
	b, err := strconv.ParseBool(s)
	if err != nil {
		return errors.New("give true or false")
	}
	*o.p = strconv.FormatBool(b)
	return nil
}

func (optBool) IsBoolFlag() bool { return true }
