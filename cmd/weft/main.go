// Command weft is the node binary: `weft router` runs the peer, the other
// subcommands talk to a running one.
package main

import (
	"fmt"
	"os"
)

var commands = map[string]func(args []string) error{
	"router":  cmdRouter,
	"status":  cmdStatus,
	"version": cmdVersion,
	"demo":    cmdDemo,
	"rmpeer":  cmdRmpeer,
	"reset":   cmdReset,
	"sleep":   cmdSleep,

	"install-cni": cmdInstallCNI,
}

const usage = `usage: weft <command> [flags]

commands:
  router    run the weft peer of this node (the daemon)
  status    show a router's status: weft status [ipam|peers|connections|report]
  rmpeer    take over the ranges of a peer that is gone for good: weft rmpeer NAME
  reset     take this node out of the cluster: hand its ranges to a live peer,
            remove its bridge, CNI config and state, stop its router: weft reset [--force];
            with no router running and --force: remove what weft left on the node
  install-cni  copy weft-cni and portmap from beside this binary into a directory:
            weft install-cni /opt/cni/bin (the DaemonSet's init container runs it)
  sleep     wait until SIGTERM (the uninstall DaemonSet's main container)
  demo      build a local cluster in network namespaces and show it working
  version   print the version

Run 'weft <command> -h' for the flags of a command.
`

func main() {
	if len(os.Args) < 2 {
		fmt.Fprint(os.Stderr, usage)
		os.Exit(2)
	}
	cmd, ok := commands[os.Args[1]]
	if !ok {
		if os.Args[1] == "-h" || os.Args[1] == "--help" || os.Args[1] == "help" {
			fmt.Print(usage)
			return
		}
		fmt.Fprintf(os.Stderr, "weft: unknown command %q\n\n%s", os.Args[1], usage)
		os.Exit(2)
	}
	if err := cmd(os.Args[2:]); err != nil {
		fmt.Fprintf(os.Stderr, "weft %s: %v\n", os.Args[1], err)
		os.Exit(1)
	}
}
