package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"time"

	"github.com/weft-net/weft/api"
)

func cmdRmpeer(args []string) error {
	var cf clientFlags
	fs := flag.NewFlagSet("weft rmpeer", flag.ContinueOnError)
	cf.bind(fs)
	if err := fs.Parse(args); err != nil {
		return err
	}
	if err := envDefaults(fs); err != nil {
		return err
	}
	if fs.NArg() != 1 {
		return errors.New("usage: weft rmpeer [--socket PATH] NAME|NICKNAME (a peer that is gone for good)")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	r, err := api.NewClient(cf.socket).Rmpeer(ctx, fs.Arg(0))
	if err != nil {
		return err
	}
	fmt.Println(r.Message)
	return nil
}
