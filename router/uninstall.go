package router

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"syscall"

	"github.com/weft-net/weft/state"
)

// UninstallConfig names what a router made on a node, as its flags did.
type UninstallConfig struct {
	CNIConfDir string // --cni-conf-dir: 10-weft.conflist is removed from it
	Bridge     string // --bridge: removed with weft's nftables table
	StateDir   string // --state-dir: the state file is removed from it, then the directory if empty
	// Socket is the router's --socket: a socket file a killed router left
	// there is removed, then its directory if empty. "": left alone.
	Socket string
	Kernel Kernel // nil: HostKernel (this namespace)
}

// podVethRemover is the part of a Kernel that removes the host ends of
// the pods' veths (HostKernel.RemovePodVeths); a Kernel without it (a
// test's fake) leaves the pods' links alone.
type podVethRemover interface {
	RemovePodVeths(log *slog.Logger) (int, error)
}

// Uninstall removes from this node what a router made, when no router runs
// any more (weft reset --force once the DaemonSet is gone): the CNI config
// first, so that the runtime stops attaching pods here and the node turns
// NotReady, then the bridge with its nftables table and the kernel IPIP
// device, the host ends of the pods' veths (pods still running have no
// network behind them any more), then the state file and the state dir
// if that is then empty, and a socket file left by a killed router with
// its directory if empty. The CNI plugin binaries stay. The state is
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
	if vr, ok := cfg.Kernel.(podVethRemover); ok {
		switch n, err := vr.RemovePodVeths(log); {
		case err != nil:
			errs = append(errs, fmt.Errorf("uninstall: %w", err))
		case n > 0:
			log.Info("uninstall: removed the host ends of pods' veths: those pods have no network until they are made again under another pod network", "veths", n)
		}
	}
	if dbPath != "" {
		if err := os.Remove(dbPath); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, fmt.Errorf("uninstall: removing the state: %w", err))
		} else {
			log.Info("uninstall: removed the state; a router started here joins as a new peer", "path", dbPath)
		}
	}
	if err := removeEmptyDir(cfg.StateDir, "the state dir", log); err != nil {
		errs = append(errs, fmt.Errorf("uninstall: %w", err))
	}
	if cfg.Socket != "" {
		if fi, err := os.Lstat(cfg.Socket); err == nil && fi.Mode()&os.ModeSocket != 0 {
			if err := os.Remove(cfg.Socket); err != nil && !errors.Is(err, os.ErrNotExist) {
				errs = append(errs, fmt.Errorf("uninstall: removing the socket a stopped router left: %w", err))
			} else {
				log.Info("uninstall: removed the socket a stopped router left", "path", cfg.Socket)
			}
		}
		if err := removeEmptyDir(filepath.Dir(cfg.Socket), "the socket's directory", log); err != nil {
			errs = append(errs, fmt.Errorf("uninstall: %w", err))
		}
	}
	return errors.Join(errs...)
}

// removeEmptyDir removes dir if it is empty. A missing one, one that
// holds anything, and one that is a mount point (a pod's hostPath volume)
// stay, and are no error.
func removeEmptyDir(dir, what string, log *slog.Logger) error {
	err := os.Remove(dir)
	switch {
	case err == nil:
		log.Info("uninstall: removed "+what, "path", dir)
		return nil
	case errors.Is(err, os.ErrNotExist):
		return nil
	case errors.Is(err, syscall.ENOTEMPTY), errors.Is(err, syscall.EEXIST):
		log.Info("uninstall: "+what+" holds other files: left in place", "path", dir)
		return nil
	case errors.Is(err, syscall.EBUSY):
		log.Info("uninstall: "+what+" is a mount point: left in place (empty)", "path", dir)
		return nil
	}
	return fmt.Errorf("removing %s: %w", what, err)
}
