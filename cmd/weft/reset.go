package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"time"

	"github.com/weft-net/weft/api"
)

// resetGone bounds how long weft reset waits for the router to finish its
// teardown and exit, once it has handed its ranges over.
const resetGone = 30 * time.Second

func cmdReset(args []string) error {
	var cf clientFlags
	fs := flag.NewFlagSet("weft reset", flag.ContinueOnError)
	cf.bind(fs)
	force := fs.Bool("force", false, "leave even though pods on this node hold addresses (they may then be handed out again elsewhere)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if err := envDefaults(fs); err != nil {
		return err
	}
	if fs.NArg() != 0 {
		return errors.New("usage: weft reset [--socket PATH] [--force] (on the node to take out of the cluster)")
	}
	cl := api.NewClient(cf.socket)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	r, err := cl.Reset(ctx, *force)
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
