package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/weft-net/weft/api"
	"github.com/weft-net/weft/router"
)

// resetGone bounds how long weft reset waits for the router to finish its
// teardown and exit, once it has handed its ranges over.
const resetGone = 30 * time.Second

func cmdReset(args []string) error {
	var cf clientFlags
	fs := flag.NewFlagSet("weft reset", flag.ContinueOnError)
	cf.bind(fs)
	force := fs.Bool("force", false, "leave even though pods on this node hold addresses (they may then be handed out again elsewhere); "+
		"when no router answers on --socket, remove what it left on the node instead (the uninstall)")
	def := router.Defaults()
	uc := router.UninstallConfig{}
	fs.StringVar(&uc.CNIConfDir, "cni-conf-dir", def.CNIConfDir, "with --force and no router: the router's --cni-conf-dir, whose "+router.ConfListName+" is removed")
	fs.StringVar(&uc.Bridge, "bridge", def.Bridge, "with --force and no router: the router's --bridge, removed with weft's nftables table")
	fs.StringVar(&uc.StateDir, "state-dir", def.StateDir, "with --force and no router: the router's --state-dir, whose state file is removed (then the directory, if empty)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if err := envDefaults(fs); err != nil {
		return err
	}
	uc.Socket = cf.socket
	if fs.NArg() != 0 {
		return errors.New("usage: weft reset [--socket PATH] [--force] (on the node to take out of the cluster)")
	}
	cl := api.NewClient(cf.socket)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	r, err := cl.Reset(ctx, *force)
	if errors.Is(err, api.ErrUnreachable) {
		if !*force {
			return fmt.Errorf("%w; if the router is gone for good (weft uninstalled), give --force to remove what it left on this node", err)
		}
		// No router (the DaemonSet was deleted): nothing to hand over;
		// clean the node's files and links directly.
		fmt.Printf("no router answers at %s: removing what weft left on this node\n", cf.socket)
		log := slog.New(slog.NewTextHandler(os.Stderr, nil))
		if err := router.Uninstall(uc, log); err != nil {
			return err
		}
		fmt.Println("this node is clean of weft: no CNI config, bridge, nftables table or state (the CNI plugin binaries stay)")
		return nil
	}
	if err != nil {
		return err
	}
	fmt.Println(r.Message)
	// The router answered before its teardown: poll until it is gone.
	gone, cancelGone := context.WithTimeout(context.Background(), resetGone)
	defer cancelGone()
	t := time.NewTicker(100 * time.Millisecond)
	defer t.Stop()
	for {
		rctx, rcancel := context.WithTimeout(gone, 2*time.Second)
		err := cl.Ready(rctx)
		rcancel()
		if errors.Is(err, api.ErrUnreachable) && gone.Err() == nil {
			fmt.Println("the router has exited")
			return nil
		}
		select {
		case <-gone.Done():
			return fmt.Errorf("the router at %s still answers %s after handing its ranges over; see its log", cf.socket, resetGone)
		case <-t.C:
		}
	}
}

// cmdSleep waits until SIGTERM or SIGINT: the main container of the
// uninstall DaemonSet (deploy/uninstall), whose init container cleaned the
// node; its pods are Running once every node is clean.
func cmdSleep(args []string) error {
	if len(args) != 0 {
		return errors.New("usage: weft sleep (waits until SIGTERM)")
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	<-ctx.Done()
	return nil
}
