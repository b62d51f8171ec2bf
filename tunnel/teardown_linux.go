package tunnel

import (
	"errors"
	"fmt"

	"github.com/vishvananda/netlink"
)

// RemoveKernelIPIP deletes the kernel IPIP device name from the calling
// thread's network namespace, if there is one (weft reset: the device is
// otherwise kept across restarts so that traffic keeps flowing). Routes
// through it go with it.
func RemoveKernelIPIP(name string) error {
	l, err := netlink.LinkByName(name)
	if err != nil {
		var nf netlink.LinkNotFoundError
		if errors.As(err, &nf) {
			return nil
		}
		return fmt.Errorf("looking up %s: %w", name, err)
	}
	if _, ok := l.(*netlink.Iptun); !ok {
		return nil // not ours
	}
	if err := netlink.LinkDel(l); err != nil {
		return fmt.Errorf("removing %s: %w", name, err)
	}
	return nil
}
