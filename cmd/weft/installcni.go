package main

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"

	"github.com/weft-net/weft/router"
)

// cmdInstallCNI copies the CNI plugins from beside this binary into a
// directory: the DaemonSet's init container runs it against the host's
// /opt/cni/bin.
func cmdInstallCNI(args []string) error {
	fs := flag.NewFlagSet("install-cni", flag.ContinueOnError)
	fs.Usage = func() {
		fmt.Fprintln(fs.Output(), "usage: weft install-cni DIR\n\ncopies weft-cni and portmap from beside the weft binary into DIR (e.g. /opt/cni/bin), and the CNI loopback plugin where DIR has none")
	}
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() != 1 {
		fs.Usage()
		return fmt.Errorf("give the directory to install into, e.g. /opt/cni/bin")
	}
	exe, err := os.Executable()
	if err == nil {
		exe, err = filepath.EvalSymlinks(exe)
	}
	if err != nil {
		return fmt.Errorf("finding the weft binary (the plugins are installed from beside it): %w", err)
	}
	changed, err := router.InstallPlugins(filepath.Dir(exe), fs.Arg(0))
	if err != nil {
		return err
	}
	if len(changed) == 0 {
		fmt.Printf("the CNI plugins in %s are up to date\n", fs.Arg(0))
	}
	for _, c := range changed {
		fmt.Printf("installed %s\n", c)
	}
	return nil
}
