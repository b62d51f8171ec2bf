package cni

import (
	"errors"
	"fmt"

	"github.com/containernetworking/cni/pkg/types"

	"github.com/weft-net/weft/api"
)

// routerError turns a failure of the local API into the CNI error the runtime
// sees; doing says what the plugin asked for ("allocating an address for …").
//
//   - not ready and unreachable become ErrTryAgainLater (11), so the runtime
//     retries instead of giving up on the pod;
//   - a request the router calls invalid names the environment variables the
//     attachment came from (ErrInvalidEnvironmentVariables);
//   - an exhausted address space says so and what to do;
//   - anything else is ErrInternal with the router's words.
func routerError(doing string, err error) error {
	if err == nil {
		return nil
	}
	var te *types.Error
	if errors.As(err, &te) {
		return te
	}
	var ae *api.Error
	if errors.As(err, &ae) {
		switch ae.Code {
		case api.CodeNotReady:
			// The router sends the bare reason with this code.
			return types.NewError(types.ErrTryAgainLater, "weft router not ready: "+ae.Message+"; try again later", doing)
		case api.CodeInvalid:
			return types.NewError(types.ErrInvalidEnvironmentVariables,
				fmt.Sprintf("weft router refused %s: %s (check CNI_CONTAINERID and CNI_IFNAME)", doing, ae.Message), "")
		case api.CodeExhausted:
			return types.NewError(types.ErrInternal,
				fmt.Sprintf("weft router has no free pod address (%s): %s; delete unused pods or give the cluster a larger --ipalloc-range", doing, ae.Message), "")
		default:
			return types.NewError(types.ErrInternal, fmt.Sprintf("weft router failed %s: %s", doing, ae.Message), ae.Code)
		}
	}
	if errors.Is(err, api.ErrUnreachable) {
		return types.NewError(types.ErrTryAgainLater, fmt.Sprintf("%s: %v; try again when the weft router is up", doing, err), "")
	}
	return types.NewError(types.ErrInternal, fmt.Sprintf("%s: %v", doing, err), "")
}

// internalError is an ErrInternal CNI error that keeps err in its message.
func internalError(format string, args ...any) error {
	return types.NewError(types.ErrInternal, fmt.Errorf(format, args...).Error(), "")
}
