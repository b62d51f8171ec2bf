package router

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"

	"github.com/weft-net/weft/state"
)

// UninstallConfig names what a router made on a node, as its flags did.
type UninstallConfig struct {
	CNIConfDir string // --cni-conf-dir: 10-weft.conflist is removed from it
	Bridge     string // --bridge: removed with weft's nftables table
	StateDir   string // --state-dir: the state file is removed from it
	Kernel     Kernel // nil: HostKernel (this namespace)
}

// Uninstall removes from this node what a router made, when no router runs
// any more (weft reset --force once the DaemonSet is gone): the CNI config
// first, so that the runtime stops attaching pods here and the node turns
// NotReady, then the bridge with its nftables table and the kernel IPIP
// device, then the state file. The CNI plugin binaries stay. The state is
// opened first: while a router holds it, nothing is removed
// (state.ErrLocked). Every step that finds nothing to remove succeeds, so
// it can be run again.
func Uninstall(cfg UninstallConfig, log *slog.Logger) error {
	if cfg.Kernel == nil {
		cfg.Kernel = &HostKernel{} // Teardown opens what it needs for the call
	}
	if cfg.CNIConfDir == "" || cfg.Bridge == "" || cfg.StateDir == "" {
		return errors.New("uninstall: give --cni-conf-dir, --bridge and --state-dir as the router had them")
	}
	var dbPath string
	if _, err := os.Stat(filepath.Join(cfg.StateDir, state.FileName)); err == nil {
		db, err := state.Open(cfg.StateDir) // fails while a router holds it
		if err != nil {
			return fmt.Errorf("uninstall: %w", err)
		}
		dbPath = db.Path()
		db.Close()
	}
	var errs []error
	switch removed, conf, err := removeConfList(cfg.CNIConfDir); {
	case err != nil:
		errs = append(errs, fmt.Errorf("uninstall: %w", err))
	case removed:
		log.Info("uninstall: removed the CNI config; the node is NotReady until another network is installed", "path", conf)
	}
	if err := cfg.Kernel.Teardown(cfg.Bridge, log); err != nil {
		errs = append(errs, fmt.Errorf("uninstall: %w", err))
	}
	if dbPath != "" {
		if err := os.Remove(dbPath); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, fmt.Errorf("uninstall: removing the state: %w", err))
		} else {
			log.Info("uninstall: removed the state; a router started here joins as a new peer", "path", dbPath)
		}
	}
	return errors.Join(errs...)
}
