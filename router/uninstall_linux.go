package router

import (
	"errors"
	"fmt"
	"log/slog"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/weft-net/weft/cni"
)

// RemovePodVeths deletes, in this network namespace, the host ends of the
// pods' veths that weft's CNI plugin made (links of type veth named as
// cni.HostVethName gives), and says how many it deleted. Each pod's own
// end goes with its host end. Uninstall runs it once the bridge is gone:
// a pod still running then has no bridge, route or router behind its
// interface, and the node is left with nothing of weft.
func (*HostKernel) RemovePodVeths(log *slog.Logger) (int, error) {
	links, err := netlink.LinkList()
	for try := 0; errors.Is(err, netlink.ErrDumpInterrupted) && try < 3; try++ {
		links, err = netlink.LinkList() // the list changed meanwhile
	}
	if err != nil {
		return 0, fmt.Errorf("listing links: %w", err)
	}
	var errs []error
	n := 0
	for _, l := range links {
		name := l.Attrs().Name
		if l.Type() != "veth" || !cni.IsHostVethName(name) {
			continue
		}
		var notFound netlink.LinkNotFoundError
		if err := netlink.LinkDel(l); err != nil && !errors.As(err, &notFound) && !errors.Is(err, unix.ENODEV) {
			errs = append(errs, fmt.Errorf("deleting the pod veth %s: %w", name, err))
			continue
		}
		log.Info("deleted a pod's host veth", "veth", name)
		n++
	}
	return n, errors.Join(errs...)
}
