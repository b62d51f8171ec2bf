//go:build !linux

package tunnel

import "errors"

func (d *Device) openKernel() error {
	return errors.New("the tunnel's kernel data plane needs Linux; pass Config.TUN and the binds to use it elsewhere")
}
