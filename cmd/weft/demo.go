package main

import (
	"context"
	"errors"
	"flag"
	"os"
	"os/signal"
	"syscall"

	"github.com/weft-net/weft/internal/nscluster"
)

func cmdDemo(args []string) error {
	o := nscluster.DemoOptions{Nodes: 3, Pods: 2, Out: os.Stdout}
	fs := flag.NewFlagSet("weft demo", flag.ContinueOnError)
	fs.IntVar(&o.Nodes, "nodes", o.Nodes, "nodes in the cluster")
	fs.IntVar(&o.Pods, "pods", o.Pods, "pods per node")
	fs.BoolVar(&o.Keep, "keep", false, "stay up until Ctrl-C, then clean up")
	fs.BoolVar(&o.Encrypt, "encrypt", false, "give the routers a shared random password: authenticated gossip, encrypted pod traffic")
	fs.StringVar(&o.Encap, "encap", "", "the routers' --encap: udp, vxlan, ipip or auto (default: the routers' own, auto)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if os.Geteuid() != 0 {
		return errors.New("the demo makes network namespaces: run it as root")
	}
	// Ctrl-C cancels the demo; Demo then removes everything before returning.
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	err := nscluster.Demo(ctx, o)
	if errors.Is(err, context.Canceled) {
		return nil
	}
	return err
}
