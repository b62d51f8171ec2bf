package nscluster

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"text/tabwriter"
	"time"
)

// DemoOptions configures Demo.
type DemoOptions struct {
	Nodes int  // nodes in the cluster
	Pods  int  // pods per node
	Keep  bool // stay up until ctx ends, for poking around
	// Encap is the routers' --encap (udp, ipip, auto); empty = their default.
	Encap string
	// Encrypt gives every router the same random password (a file in the
	// run's directory): authenticated gossip, encrypted pod traffic.
	Encrypt bool
	Out     io.Writer
	Log     *slog.Logger // the harness's own log (quiet by default)
	// BinDir is where the weft binaries are; empty = FindBinDir.
	BinDir string
}

// MaxDemoNodes is the most nodes the demo builds (the underlay is one
// /24 and every node runs a router: a few dozen fit on a laptop).
const MaxDemoNodes = 50

// Demo builds a cluster in network namespaces, starts a router in every
// node, attaches pods through the CNI plugin, prints the ping matrix and
// every node's status, and removes everything before it returns, also when
// ctx is cancelled (Ctrl-C). It returns an error if any ping failed.
func Demo(ctx context.Context, o DemoOptions) (err error) {
	if o.Nodes < 1 || o.Nodes > MaxDemoNodes {
		return fmt.Errorf("--nodes %d: give 1 to %d nodes", o.Nodes, MaxDemoNodes)
	}
	if o.Pods < 1 || o.Pods > 50 {
		return fmt.Errorf("--pods %d: give 1 to 50 pods per node", o.Pods)
	}
	if o.Log == nil {
		o.Log = slog.New(slog.DiscardHandler)
	}
	out := o.Out
	step := func(format string, args ...any) { fmt.Fprintf(out, "==> "+format+"\n", args...) }

	run, err := NewRun(Options{Log: o.Log, BinDir: o.BinDir})
	if err != nil {
		return err
	}
	defer func() {
		step("removing everything the demo made (namespaces, links, processes, files)")
		if cerr := run.Close(); cerr != nil {
			err = errors.Join(err, cerr)
			return
		}
		step("done: nothing left behind")
	}()

	step("building a %d-node cluster in network namespaces (prefix %s), underlay 10.250.0.0/24", o.Nodes, run.Prefix())
	c, err := run.NewCluster(ctx, ClusterOpts{Nodes: o.Nodes})
	if err != nil {
		return err
	}
	var peers []string
	for _, n := range c.Nodes {
		peers = append(peers, n.UnderlayIP.String())
	}
	args := []string{"--peers", strings.Join(peers, ",")} // as a DaemonSet's peer list
	if o.Encap != "" {
		args = append(args, "--encap", o.Encap)
	}
	if o.Encrypt {
		key := make([]byte, 24)
		if _, err := rand.Read(key); err != nil {
			return err
		}
		pw := filepath.Join(run.Dir(), "password")
		if err := os.WriteFile(pw, []byte(base64.StdEncoding.EncodeToString(key)+"\n"), 0o600); err != nil {
			return err
		}
		args = append(args, "--password-file", pw)
	}
	for _, n := range c.Nodes {
		step("starting weft router on %s (namespace %s, %s): weft router %s", n.Name, n.NS, n.UnderlayIP, strings.Join(args, " "))
		if _, err := n.StartRouter(args...); err != nil {
			return err
		}
	}
	for _, n := range c.Nodes {
		wctx, cancel := context.WithTimeout(ctx, time.Minute)
		err := n.WaitReady(wctx)
		cancel()
		if err != nil {
			return err
		}
		step("%s is ready: it installed weft-cni and wrote its conflist", n.Name)
	}

	var pods []*Pod
	for _, n := range c.Nodes {
		for i := range o.Pods {
			p, err := n.AddPod(ctx, fmt.Sprintf("pod%d", i+1))
			if err != nil {
				return err
			}
			pods = append(pods, p)
		}
	}
	step("attached %d pods through the CNI plugin (libcni, as containerd runs it):", len(pods))
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "    POD\tNAMESPACE\tADDRESS\tGATEWAY")
	for _, p := range pods {
		fmt.Fprintf(tw, "    %s\t%s\t%s\t%s\n", p, p.NS, p.Prefix, p.Gateway)
	}
	tw.Flush()

	step("ping matrix (row pings column; pods on other nodes are reached through the tunnel):")
	m := PingMatrix(ctx, pods)
	fmt.Fprint(out, indent(m.String(), "    "))
	var failures []string
	failures = append(failures, m.Failures()...)
	for _, p := range pods {
		for _, n := range c.Nodes {
			gw, err := n.Gateway(ctx)
			if err == nil {
				err = Ping(ctx, p.NS, gw)
			}
			if err != nil {
				failures = append(failures, fmt.Sprintf("%s -> node %s (%v)", p, n.Name, err))
			}
		}
	}
	if len(failures) == 0 {
		step("every pod reached every other pod and every node's bridge")
	}

	for _, n := range c.Nodes {
		for _, args := range [][]string{{"status"}, {"status", "ipam"}, {"status", "connections"}} {
			step("weft %s   (on %s)", strings.Join(args, " "), n.Name)
			text, err := n.Weft(ctx, args...)
			if err != nil {
				return err
			}
			fmt.Fprint(out, indent(string(text), "    "))
		}
	}

	if o.Keep && ctx.Err() == nil {
		step("staying up until Ctrl-C. Try:")
		fmt.Fprintf(out, "    ip netns exec %s ping %s\n", pods[0].NS, pods[len(pods)-1].IP)
		fmt.Fprintf(out, "    ip netns exec %s %s/weft status ipam\n", c.Nodes[0].NS, mustBinDir(run))
		fmt.Fprintf(out, "    router log: %s\n", c.Nodes[0].RouterLog)
		<-ctx.Done()
	}
	if len(failures) > 0 {
		return fmt.Errorf("%d pings failed: %s", len(failures), strings.Join(failures, "; "))
	}
	return ctx.Err()
}

func mustBinDir(r *Run) string {
	d, err := r.BinDir()
	if err != nil {
		return "bin"
	}
	return d
}

func indent(s, prefix string) string {
	lines := strings.SplitAfter(s, "\n")
	var b strings.Builder
	for _, l := range lines {
		switch l {
		case "":
		case "\n":
			b.WriteString(l)
		default:
			b.WriteString(prefix + l)
		}
	}
	if !strings.HasSuffix(b.String(), "\n") {
		b.WriteByte('\n')
	}
	return b.String()
}
