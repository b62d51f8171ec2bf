//go:build !linux

package cni

import (
	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"
)

func errNotLinux() error {
	return types.NewError(types.ErrInternal, "weft-cni attaches pods only on Linux", "")
}

// Add answers ADD; weft-cni attaches pods only on Linux.
func (p *Plugin) Add(*skel.CmdArgs) error { return errNotLinux() }

// Del answers DEL; weft-cni attaches pods only on Linux.
func (p *Plugin) Del(*skel.CmdArgs) error { return errNotLinux() }

// Check answers CHECK; weft-cni attaches pods only on Linux.
func (p *Plugin) Check(*skel.CmdArgs) error { return errNotLinux() }
