package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"time"
)

// clientFlags are the flags of every subcommand that talks to a router.
type clientFlags struct {
	httpAddr string
	socket   string
}

func (c *clientFlags) bind(fs *flag.FlagSet) {
	fs.StringVar(&c.httpAddr, "http-addr", "127.0.0.1:6784", "the router's status address (its --http-addr)")
	fs.StringVar(&c.socket, "socket", "/run/weft/weft.sock", "the router's local API socket (its --socket)")
}

func cmdStatus(args []string) error {
	var cf clientFlags
	fs := flag.NewFlagSet("weft status", flag.ContinueOnError)
	cf.bind(fs)
	if err := fs.Parse(args); err != nil {
		return err
	}
	if err := envDefaults(fs); err != nil {
		return err
	}
	path := "/status"
	switch sub := fs.Arg(0); sub {
	case "":
	case "ipam":
		path = "/status/ipam"
	case "peers":
		path = "/status/peers"
	case "connections":
		path = "/status/connections"
	case "policy":
		path = "/status/policy"
	case "report":
		path = "/report"
	default:
		return fmt.Errorf("unknown status %q: use weft status [ipam|peers|connections|policy|report]", sub)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+cf.httpAddr+path, nil)
	if err != nil {
		return err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return fmt.Errorf("cannot reach the weft router at %s: %w (is it running? in which network namespace? pass its --http-addr)", cf.httpAddr, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		return fmt.Errorf("router at %s answered %s: %s", cf.httpAddr, resp.Status, b)
	}
	_, err = io.Copy(os.Stdout, resp.Body)
	return err
}
